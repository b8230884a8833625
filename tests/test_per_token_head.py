"""Per-token-head dynamic FP8 KV scales (``k_scale_cache`` / ``v_scale_cache``): each written
row quantised with its own scale ``max(amax / 448, 1e-6)``, the scale written beside it, in
vLLM 0.34's ``fp8_per_token_head`` cache layout (``qkrope.vllm_per_token_head_views``) and in
separate scale tensors; both entry points; special rows; skipped rows untouched. CPU: the real
kernel in Triton's interpreter."""

import numpy as np
import pytest
import torch
from helpers import DEVICE, Case, division_check, make_inputs
from test_qknorm_rope import PCase, make

import qkrope
from qkrope.ops.qknorm_rope import launcher
from qkrope.ops.qknorm_rope.reference import quantize_token_head

FP8 = torch.float8_e4m3fn
POISON = -7.0  # scale-cache entries no call should touch


def vllm_cache(nb, Hkv, bs, D, generator, dtype=FP8):
    """A per-layer vLLM fp8/int8_per_token_head cache of random bytes (its rows and scales
    are whatever was there) and the four views the op writes through."""
    raw = torch.randint(0, 256, (nb, Hkv, bs, 2 * (D + 4)), dtype=torch.uint8,
                        generator=generator).to(DEVICE)
    views = qkrope.vllm_per_token_head_views(raw, D, dtype)
    views[2].fill_(POISON)
    views[3].fill_(POISON)
    return raw, views


def vllm_read(raw, slot, head, D, dtype=FP8):
    """Decode one (slot, head) cell as vLLM's Triton attention reads it: the code bytes as
    float times the float32 scale stored after them, for K and for V."""
    bs = raw.shape[2]
    cell = raw[slot // bs, head, slot % bs]
    k = cell[:D].view(dtype).float() * cell[D:D + 4].view(torch.float32)
    v = cell[D + 4:2 * D + 4].view(dtype).float() * cell[2 * D + 4:].view(torch.float32)
    return k, v


def error_bound(x, scale, dtype=FP8):
    """|decoded - x| a rounding allows: e4m3, half an ulp of 3 mantissa bits or half the
    subnormal step (2**-9 of the scale) near zero; int8, half a step of the scale."""
    if dtype == torch.int8:
        return scale * 0.5001 + x.abs() * 2.0**-20
    return torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * 1.0001


@pytest.mark.parametrize("dtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("layout", ["vllm", "NHD", "HND"])
def test_paged_rows_and_scales_as_vllm_reads_them(layout, dtype):
    c = PCase(T=11, Hq=4, Hkv=2, D=64, num_blocks=4, block_size=8, layout="NHD" if layout ==
              "vllm" else layout, seed=5)
    args, kwargs = make(c)
    g = torch.Generator().manual_seed(1)
    if layout == "vllm":
        raw, (kc, vc, ksc, vsc) = vllm_cache(c.num_blocks, c.Hkv, c.block_size, c.D, g, dtype)
    else:
        kc, vc = args[4].to(dtype), args[5].to(dtype)
        ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)
        vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
    before = [t.clone() for t in (kc.view(torch.uint8), vc.view(torch.uint8), ksc, vsc)]
    call = (*args[:4], kc, vc, *args[6:])
    q_rot, k_rot = qkrope.fused_qk_norm_rope_paged(*call, **kwargs, k_scale_cache=ksc,
                                                   v_scale_cache=vsc)
    # The oracle on copies of the same caches: V (not rotated) bit for bit; K from the
    # kernel's own rotated rows bit for bit (and from the oracle's but for a rare last ulp).
    r = [t.clone() for t in (kc, vc, ksc, vsc)]
    ref = qkrope.reference_paged(*args[:4], r[0], r[1], *args[6:], **kwargs, k_scale_cache=r[2],
                                 v_scale_cache=r[3], inplace=True)
    assert torch.equal(vc.view(torch.uint8), r[1].view(torch.uint8))
    assert torch.equal(vsc, r[3])
    assert (kc.view(torch.uint8) == r[0].view(torch.uint8)).float().mean() > 0.99
    slots, bs = args[6].long().cpu(), c.block_size
    written = torch.zeros(c.num_blocks * bs, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if not 0 <= slot < c.num_blocks * bs:
            continue
        written[slot] = True
        blk, off = slot // bs, slot % bs
        codes, scales = quantize_token_head(k_rot[t], dtype)  # [Hkv, D], [Hkv]
        got = kc[blk, off] if c.layout == "NHD" else kc[blk, :, off]
        got_s = ksc[blk, off] if c.layout == "NHD" else ksc[blk, :, off]
        assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(got_s, scales)
        if layout == "vllm":
            for h in range(c.Hkv):
                k, v = vllm_read(raw, slot, h, c.D, dtype)
                assert ((k - k_rot[t, h].float()).abs()
                        <= error_bound(k_rot[t, h].float(), scales[h], dtype)).all()
                vt = args[2][t, h].float()
                assert ((v - vt).abs() <= error_bound(vt, vsc[blk, off, h], dtype)).all()
    # Every slot no token names keeps its rows and scales, bit for bit.
    def rows_of(t, slot_mask):
        t = t.flatten(0, 1) if c.layout == "NHD" else t.transpose(1, 2).flatten(0, 1)
        return t[slot_mask.to(t.device)]
    for new, old in zip((kc.view(torch.uint8), vc.view(torch.uint8), ksc, vsc), before):
        assert torch.equal(rows_of(new, ~written), rows_of(old, ~written))
    assert ref[0].shape == q_rot.shape


def test_bhsd_entry_point_with_scale_caches():
    args = make_inputs(Case(B=2, Hq=4, Hkv=2, S=5, L=16, pad_rows=(1,), far_rows=(3,)))
    kc, vc = args[4].to(FP8), args[5].to(FP8)
    ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)  # [B, Hkv, L]
    vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
    call = (*args[:4], kc, vc, *args[6:])
    r = [t.clone() for t in (kc, vc, ksc, vsc)]
    q_rot, k_rot, _, _ = qkrope.run(*call, k_scale_cache=ksc, v_scale_cache=vsc)
    qkrope.reference(*args[:4], r[0], r[1], *args[6:], k_scale_cache=r[2], v_scale_cache=r[3],
                     inplace=True)
    assert torch.equal(vc.view(torch.uint8), r[1].view(torch.uint8)) and torch.equal(vsc, r[3])
    rows = args[6].long()
    keep = (rows >= 0) & (rows < kc.shape[2])
    codes, scales = quantize_token_head(k_rot[:, :, keep], FP8)
    assert torch.equal(kc[:, :, rows[keep]].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(ksc[:, :, rows[keep]], scales)
    untouched = torch.ones(kc.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[rows[keep]] = False
    assert (ksc[:, :, untouched] == POISON).all() and (vsc[:, :, untouched] == POISON).all()


@pytest.mark.parametrize("name", ["k_scale_cache", "v_scale_cache"])
def test_inplace_false_with_a_scale_cache_is_refused_and_writes_nothing(name):
    # inplace=False copies the caches; the scales of the copies would land in the caller's
    # scale cache, whose own rows would then read back wrong.
    args = make_inputs(Case(B=1, Hq=2, Hkv=1, S=2, L=4, seed=12))
    kc, vc = args[4].to(FP8), args[5].to(FP8)
    ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)
    vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
    before = [t.clone() for t in (kc, vc)]
    scale_caches = dict(k_scale_cache=ksc, v_scale_cache=vsc) if name == "k_scale_cache" else \
        dict(v_scale_cache=vsc, k_scale=0.05)
    with pytest.raises(ValueError, match=f"inplace=False copies the caches but not {name}"):
        qkrope.run(*args[:4], kc, vc, *args[6:], inplace=False, **scale_caches)
    assert (ksc == POISON).all() and (vsc == POISON).all()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip((kc, vc), before))


def _write_fp8_rows(args, kwargs, v):
    """The paged op on ``args`` with V ``v`` (4 tokens) into slots 0-3 of FP8 caches with
    per-token-head scales (poisoned): ``(value_cache, v_scale_cache)``."""
    slots = torch.arange(4, device=DEVICE, dtype=args[6].dtype)
    kc, vc = args[4].to(FP8), args[5].to(FP8)
    ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)
    vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
    call = (*args[:2], v, args[3], kc, vc, slots, *args[7:])
    qkrope.fused_qk_norm_rope_paged(*call, **kwargs, k_scale_cache=ksc, v_scale_cache=vsc)
    return vc, vsc


@pytest.fixture(params=["picked", "one_row"])
def tile(request, monkeypatch):
    """The launch's tile: pick_config's (the interpreter's whole head groups; a GPU's decode
    tile for these few tokens), or one row a program forced, so the interpreter runs the
    integer amax of one-row tiles too (quantize._token_head_amax)."""
    if request.param == "one_row":
        monkeypatch.setattr(launcher, "pick_config", lambda *a: launcher.TileConfig(1, 1, 1, 1))
    return request.param


def test_zero_nan_inf_and_huge_rows(tile):
    args, kwargs = make(PCase(T=4, Hq=2, Hkv=2, D=64, seed=7))
    v = args[2].clone()
    v[0, 0] = 0                        # all zeros: scale 1e-6, codes 0
    v[0, 1, 3] = float("nan")          # NaN: not in the amax, stored as 0x7F
    v[1, 0, 5] = float("inf")          # inf: scale inf, the row 0 but the inf (NaN)
    v[1, 1] = 3e4                      # huge: scale 3e4 / 448, codes 448
    v[2, 0] = float("nan")             # all NaN: nothing in the amax, scale 1e-6, codes 0x7F
    vc, vsc = _write_fp8_rows(args, kwargs, v)
    codes, scales = quantize_token_head(v, FP8)
    assert torch.equal(vc[0, :4].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(vsc[0, :4], scales)
    assert vsc[0, 0, 0] == torch.tensor(1e-6) and (vc[0, 0, 0].view(torch.uint8) == 0).all()
    nan_codes = vc[0, 0, 1].view(torch.uint8)
    others = torch.arange(64, device=DEVICE) != 3
    assert nan_codes[3] == 0x7F and (nan_codes[others] != 0x7F).all()
    assert vsc[0, 1, 0] == float("inf") and vc[0, 1, 0].view(torch.uint8)[5] == 0x7F
    assert (vc[0, 1, 1].float().abs() == 448).all()
    assert vsc[0, 2, 0] == torch.tensor(1e-6) and (vc[0, 2, 0].view(torch.uint8) == 0x7F).all()


@pytest.mark.parametrize("dtype, snan", [(torch.bfloat16, 0x7FA0), (torch.float16, 0x7D00)],
                         ids=["bf16", "fp16"])
def test_a_signalling_nan_is_not_counted_in_the_amax(dtype, snan, tile):
    # A signalling NaN (quiet bit clear) anywhere in a V row: like a quiet one, it is left out
    # of the row's amax. The interpreter's max counted it at some positions (a scale of 1e-6 or
    # of a partial max: codes saturated).
    args, kwargs = make(PCase(T=4, Hq=2, Hkv=2, D=64, dtype=dtype, seed=8))
    v = args[2].clone()
    v[:, :, 0] = 448.0
    for t, pos in enumerate((5, 61, 63, 62)):
        v.view(torch.int16)[t, t % 2, pos] = snan
    vc, vsc = _write_fp8_rows(args, kwargs, v)
    codes, scales = quantize_token_head(v, FP8)
    assert torch.equal(vsc[0, :4], scales) and (scales == 1.0).all()
    assert torch.equal(vc[0, :4].view(torch.uint8), codes.view(torch.uint8))


def test_scale_caches_under_torch_compile_equal_eager():
    args, kwargs = make(PCase(T=5, seed=8))
    out = []
    for compiled in (False, True):
        kc, vc = args[4].to(FP8), args[5].to(FP8)
        ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)
        vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
        def fn(*a, ksc=ksc, vsc=vsc):
            return qkrope.fused_qk_norm_rope_paged(*a, **kwargs, k_scale_cache=ksc,
                                                   v_scale_cache=vsc)

        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)
        fn(*args[:4], kc, vc, *args[6:])
        out.append((kc.view(torch.uint8), vc.view(torch.uint8), ksc, vsc))
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change, error, words", [
    ("bf16 caches", ValueError,
     "k_scale_cache holds the per-token-head scales of a float8_e4m3fn or int8 key_cache"),
    (lambda kc, vc, ksc, vsc: (kc, vc, ksc[:, :, :1], vsc), ValueError,
     "k_scale_cache must have shape"),
    (lambda kc, vc, ksc, vsc: (kc, vc, ksc.double(), vsc), TypeError,
     "k_scale_cache must be float32"),
    (lambda kc, vc, ksc, vsc: (kc, vc, ksc, ksc), ValueError,
     "overlaps"),
])
def test_scale_cache_arguments_are_checked_by_name(change, error, words):
    args, kwargs = make(PCase(T=3, seed=9))
    kc, vc = args[4].to(FP8), args[5].to(FP8)
    ksc, vsc = (torch.zeros(kc.shape[:-1], device=DEVICE) for _ in range(2))
    if change == "bf16 caches":
        kc, vc, vsc = args[4], args[5], None
    else:
        kc, vc, ksc, vsc = change(kc, vc, ksc, vsc)
    with pytest.raises(error, match=words):
        qkrope.fused_qk_norm_rope_paged(*args[:4], kc, vc, *args[6:], **kwargs,
                                        k_scale_cache=ksc, v_scale_cache=vsc)


def test_static_and_dynamic_scales_are_exclusive_per_cache():
    args, kwargs = make(PCase(T=3, cache_dtype=FP8, seed=10))  # kwargs carry k_scale, v_scale
    kc, vc = args[4], args[5]
    with pytest.raises(ValueError, match="k_scale is only used with a float8_e4m3fn or float8_e5m2 key_out"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs,
                                        k_scale_cache=torch.zeros(kc.shape[:-1], device=DEVICE))
    kwargs.pop("k_scale")
    with pytest.raises(ValueError, match="v_scale is not used"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs,
                                        k_scale_cache=torch.zeros(kc.shape[:-1], device=DEVICE),
                                        v_scale_cache=torch.zeros(vc.shape[:-1], device=DEVICE))


def test_vllm_views_take_a_typed_cache_s_own_dtype_and_refuse_a_contradiction():
    for dtype in (torch.int8, FP8):
        kv = torch.zeros(2, 2, 4, 2 * (64 + 4), dtype=dtype)
        assert all(v.dtype == dtype for v in qkrope.vllm_per_token_head_views(kv, 64)[:2])
        other = FP8 if dtype == torch.int8 else torch.int8
        with pytest.raises(ValueError, match="dtype .* contradicts kv_cache's own dtype"):
            qkrope.vllm_per_token_head_views(kv, 64, other)
    kv = torch.zeros(2, 2, 4, 2 * (64 + 4), dtype=torch.uint8)  # vLLM's bytes: FP8 by default
    assert qkrope.vllm_per_token_head_views(kv, 64)[0].dtype == FP8


def test_vllm_views_refuse_a_cache_of_another_shape():
    with pytest.raises(ValueError, match="2 \\(head_size \\+ 4\\)"):
        qkrope.vllm_per_token_head_views(torch.zeros(2, 2, 4, 128, dtype=torch.uint8), 64)


def test_int8_zero_nan_inf_and_huge_rows(tile):
    args, kwargs = make(PCase(T=4, Hq=2, Hkv=2, D=64, seed=11))
    v = args[2].clone()
    v[0, 0] = 0                        # all zeros: scale 1e-6, codes 0
    v[0, 1, 3] = float("nan")          # int8 has no NaN: the row's scale NaN, its codes 0
    v[1, 0, 5] = float("inf")          # scale inf: every element reads back NaN
    v[1, 1] = -3e4                     # huge: codes -127 (half away from zero, saturated)
    v[2, 0] = float("nan")             # all NaN: scale NaN, codes 0
    slots = torch.tensor([0, 1, 2, 3], device=DEVICE, dtype=args[6].dtype)
    kc, vc = args[4].to(torch.int8), args[5].to(torch.int8)
    ksc = torch.full(kc.shape[:-1], POISON, device=DEVICE)
    vsc = torch.full(vc.shape[:-1], POISON, device=DEVICE)
    qkrope.fused_qk_norm_rope_paged(*args[:2], v, args[3], kc, vc, slots, *args[7:], **kwargs,
                                    k_scale_cache=ksc, v_scale_cache=vsc)
    codes, scales = quantize_token_head(v, torch.int8)
    assert torch.equal(vc[0, :4], codes)
    assert torch.equal(vsc[0, :4].nan_to_num(-1), scales.nan_to_num(-1))
    assert vsc[0, 0, 0] == torch.tensor(1e-6) and (vc[0, 0, 0] == 0).all()
    assert vsc[0, 0, 1].isnan() and (vc[0, 0, 1] == 0).all()
    assert vsc[0, 1, 0] == float("inf")
    assert (vc[0, 1, 1] == -127).all()
    assert vsc[0, 2, 0].isnan() and (vc[0, 2, 0] == 0).all()
    decoded = vc[0, :4].float() * vsc[0, :4, :, None]
    assert decoded[0, 1].isnan().all() and decoded[1, 0].isnan().all()


def test_int8_cache_needs_scale_caches():
    args, kwargs = make(PCase(T=3, seed=12))
    kc, vc = args[4].to(torch.int8), args[5].to(torch.int8)
    with pytest.raises(ValueError, match="an int8 key_cache takes per-token-head scales: pass "
                                         "k_scale_cache"):
        qkrope.fused_qk_norm_rope_paged(*args[:4], kc, vc, *args[6:], **kwargs)


@pytest.mark.parametrize("Q", [127.0, 448.0])
def test_a_rows_scale_quotient_is_the_ieee_quotient_for_every_amax(Q):
    """On a GPU the kernel computes a row's ``amax / Q`` as ``quantize._quotient``: a product by
    RN(1/Q) and one FMA correction (the interpreter divides). Emulated with exact FMAs, that
    equals the IEEE quotient for every amax a row can have (each bf16 and fp16 value >= 0, and
    inf), and the check has teeth: the product alone differs."""
    check = division_check()
    F32, F64 = check.F32, check.F64
    x = np.concatenate([check.every_value(torch.bfloat16), check.every_value(torch.float16),
                        [np.inf]]).astype(F32)
    x = x[x >= 0]
    want = (x.astype(F64) / F64(Q)).astype(F32)
    r = np.full_like(x, F32(1.0 / F64(Q)))
    q0 = (x.astype(F64) * r.astype(F64)).astype(F32)
    with np.errstate(invalid="ignore"):  # (Triton's -q0 is 0 - q0)
        q1 = check.fma32(check.fma32(F32(0) - q0, np.full_like(x, F32(Q)), x), r, q0)
    assert np.array_equal(np.where(q1 == q1, q1, q0), want)
    assert not np.array_equal(q0, want)  # the product alone


@pytest.mark.parametrize("Q", [127.0, 448.0])
def test_one_newton_step_gives_the_reciprocal_of_every_rows_scale(Q):
    """On a GPU the kernel makes a row's codes with ``RN(1/s)`` from Triton's ``1 / s`` and one
    FMA Newton step (``quantize._token_head_scale``; docs/design.md, "Per-token-head
    scales"): for every scale a row can have, s = max(amax / Q, 1e-6) with amax each bf16 and
    fp16 value >= 0 (inf and NaN apart), one FMA Newton step from any start within 8 ulp of 1/s
    (Triton's `1 / s` is within 2) gives RN(1/s), as div_rn does; the check has teeth: for fp32
    scales in general the step misses (the first mantissas where it does are in the last
    assert)."""
    check = division_check()
    F32, F64 = check.F32, check.F64
    a = np.concatenate([check.every_value(torch.bfloat16),
                        check.every_value(torch.float16)]).astype(F32)
    s = np.unique(np.maximum((a[a >= 0].astype(F64) / Q).astype(F32), F32(1e-6)))
    want = (1.0 / s.astype(F64)).astype(F32)
    # An inf amax (inf scale): Triton's 1 / inf is 0, the step's NaN gives way to it; NaN stays.
    special = check.newton_reciprocal(np.array([np.inf, np.nan], dtype=F32),
                                      np.array([0.0, np.nan], dtype=F32))
    assert special[0] == 0 and np.isnan(special[1])
    for ulps in range(-8, 9):
        start = want.copy()
        for _ in range(abs(ulps)):
            start = np.nextafter(start, F32(np.inf) if ulps > 0 else F32(-np.inf))
        assert np.array_equal(check.newton_reciprocal(s, start), want), ulps
    # Teeth: fp32 scales the step misses from a start one ulp above RN(1/s) (32 of the 2**23
    # mantissas in [1, 2); one from a start one ulp below: 2 - 2**-23), none a row's scale.
    s = (1 + np.array([432403, 511045, 981571, 8388607], dtype=F64) / 2**23).astype(F32)
    want = (1.0 / s.astype(F64)).astype(F32)
    starts = np.nextafter(want, np.where(s < 1.9, F32(np.inf), F32(-np.inf)).astype(F32))
    assert not (check.newton_reciprocal(s, starts) == want).any()
