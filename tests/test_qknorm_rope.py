"""The op against its oracle, through both entry points ([B, H, S, D] and token-major /
paged), every layout, dtype, rotary style and feature: on the GPU when there is one, otherwise
the real kernel through Triton's interpreter. Every run poisons the outputs, checks every element
against a derived bound and the bit-identical fraction, and checks the caches row by row
(written rows exact, untouched rows bit-identical)."""

from dataclasses import dataclass

import pytest
import torch
from helpers import DEVICE, Case, assert_mostly_identical, make_inputs, poisoned_like, run_and_check
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import qkrope
from qkrope.ops.qknorm_rope.reference import rms_norm_ref
from qkrope.suite import rope_inv_freq


@dataclass
class PCase:
    T: int = 11
    Hq: int = 4
    Hkv: int = 2
    D: int = 64
    num_blocks: int = 4
    block_size: int = 8
    layout: str = "NHD"
    style: str = "neox"
    rotary_dim: int | None = None
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None   # float8_e4m3fn / float8_e5m2 for FP8 caches
    per_head_scale: bool = False
    packed: bool = False                      # q/k/v as views of one [T, (Hq+2Hkv) D] tensor
    shared_kv: bool = False                   # K and V caches as views of one allocation
    offset: float = 0.0
    norm_rounding: str = "weight_fp32"
    index_dtype: torch.dtype = torch.int64
    cos_sin_scale: float = 1.0
    mrope: str | None = None                  # "contiguous" / "interleaved": [3, T] positions
    seed: int = 0


def mrope_kwargs(kind, rotary_dim):
    """mRoPE keywords for ``rotary_dim``: sections like Qwen3-VL's (24, 20, 20) of 64."""
    if kind is None:
        return {}
    half = rotary_dim // 2
    h = w = (5 * half) // 16
    return dict(mrope_section=(half - h - w, h, w), mrope_interleaved=kind == "interleaved")


def three_streams(pos, generator):
    """[3, ...] temporal/height/width positions that differ (as for image tokens)."""
    other = torch.randint_like(pos, 0, 64, generator=generator)
    return torch.stack((pos, other, (pos + other) % 97))


def make(c: PCase):
    g = torch.Generator(device=DEVICE).manual_seed(c.seed)

    def rnd(*s, dtype=c.dtype):
        return torch.randn(*s, generator=g, device=DEVICE, dtype=dtype)

    if c.packed:
        qkv = rnd(c.T, (c.Hq + 2 * c.Hkv) * c.D)
        q, k, v = qkrope.split_packed_qkv(qkv, c.Hq, c.Hkv, c.D)
    else:
        q, k, v = rnd(c.T, c.Hq, c.D), rnd(c.T, c.Hkv, c.D), rnd(c.T, c.Hkv, c.D)
    shape = ((c.num_blocks, c.block_size, c.Hkv, c.D) if c.layout == "NHD"
             else (c.num_blocks, c.Hkv, c.block_size, c.D))
    cdt = c.cache_dtype or c.dtype
    if c.shared_kv:
        kv = rnd(c.num_blocks, 2, *shape[1:]).to(cdt)
        kc, vc = kv[:, 0], kv[:, 1]
    else:
        kc, vc = rnd(*shape).to(cdt), rnd(*shape).to(cdt)
    n_slots = c.num_blocks * c.block_size
    # Distinct slots, the very last one of the cache among them (second token), plus a padding
    # slot and one past the cache, both skipped.
    perm = torch.randperm(n_slots - 1, generator=torch.Generator().manual_seed(c.seed))
    slots = torch.cat((perm[: c.T - 2], torch.tensor([n_slots - 1])))
    slots = torch.cat((torch.tensor([-1]), slots[-1:], slots[:-1]))[: c.T - 1]
    slots = torch.cat((slots, torch.tensor([n_slots + 3])))
    positions = torch.randint(0, 2**18, (c.T,), generator=torch.Generator().manual_seed(c.seed))
    rot = c.rotary_dim or c.D
    qw, kw = 1 + 0.5 * rnd(c.D), 1 + 0.5 * rnd(c.D)
    inv = rope_inv_freq(rot, 1e6, DEVICE)
    kwargs = dict(cache_layout=c.layout, rotary_style=c.style, rotary_dim=c.rotary_dim,
                  norm_weight_offset=c.offset, norm_rounding=c.norm_rounding,
                  cos_sin_scale=c.cos_sin_scale, **mrope_kwargs(c.mrope, rot))
    if c.mrope:
        positions = three_streams(positions, torch.Generator().manual_seed(c.seed))
    if c.cache_dtype is not None:
        if c.per_head_scale:
            kwargs.update(k_scale=0.02 + 0.01 * torch.arange(c.Hkv, device=DEVICE),
                          v_scale=0.01 + 0.005 * torch.arange(c.Hkv, device=DEVICE))
        else:
            kwargs.update(k_scale=0.025, v_scale=0.0125)
    args = (q, k, v, positions.to(DEVICE, c.index_dtype), kc, vc, slots.to(DEVICE, c.index_dtype),
            qw, kw, inv, 1e-6)
    return args, kwargs


def partner_index(D, rot, style):
    d = torch.arange(D)
    if style == "gptj":
        p = d ^ 1
    else:
        p = torch.where(d < rot // 2, d + rot // 2, d - rot // 2)
    return torch.where(d < rot, p, d)


def check_rotated(pairs, eps, D, rotary_dim, style, offset, norm_rounding, cos_sin_scale):
    """Fused and reference rows: within the derived bound, >= 99% bit-identical.

    Both share the rounding points; fp32 details (sum order, rsqrt/sin/cos ulps) may flip a
    rounding of a normalised value: a flip moves a product by <= 2u of it plus one rounding,
    and the sum by one more, so 4u s (|n| + |n_partner|) bounds every element (s: the cos/sin
    scale, cos and sin being at most s in magnitude)."""
    p = partner_index(D, rotary_dim or D, style).to(DEVICE)
    for name, (out, ref, x, w) in zip(("query", "key"), pairs):
        u = torch.finfo(x.dtype).eps / 2
        assert not torch.isnan(out).any(), f"{name}_rotated has unwritten elements"
        n = rms_norm_ref(x, w, eps, norm_rounding, offset).float().abs()
        bound = 4 * u * max(1.0, cos_sin_scale) * (n + n[..., p])
        assert ((out.float() - ref.float()).abs() <= bound).all(), f"{name}: beyond bound"
        assert_mostly_identical(out, ref, name)


def check(c: PCase):
    args, kwargs = make(c)
    q, k, v, pos, kc, vc, slots, qw, kw, inv, eps = args
    kc0, vc0 = kc.clone(), vc.clone()
    q_out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    k_out = torch.full_like(k, float("nan"), memory_format=torch.contiguous_format)
    q_rot, k_rot = qkrope.fused_qk_norm_rope_paged(*args, **kwargs, query_out=q_out, key_out=k_out)
    assert q_rot is q_out and k_rot is k_out
    rq, rk, kc_ref, vc_ref = qkrope.reference_paged(q, k, v, pos, kc0, vc0, slots, qw, kw, inv,
                                                    eps, **kwargs)

    check_rotated(((q_rot, rq, q, qw), (k_rot, rk, k, kw)), eps, c.D, c.rotary_dim, c.style,
                  c.offset, c.norm_rounding, c.cos_sin_scale)

    # Caches: compare against the reference's caches, which hold the reference's rows; where
    # the fused K row differs by a flipped rounding, compare against the fused row instead.
    n_slots = c.num_blocks * c.block_size
    valid = (slots >= 0) & (slots < n_slots)
    bs = c.block_size
    blk, off = slots[valid].long() // bs, slots[valid].long() % bs
    rows = (lambda cache: cache[blk, off]) if c.layout == "NHD" else (
        lambda cache: cache[blk, :, off])
    if c.cache_dtype is None:
        assert torch.equal(rows(kc), k_rot[valid]), "key cache rows != key_rotated"
        assert torch.equal(rows(vc), v[valid]), "value cache rows != value"
    else:
        # FP8: dequantise; stored values are saturate(x / scale) rounded to e4m3 (3 mantissa
        # bits, subnormal step 2**-9) or e5m2 (2 bits, step 2**-16): half a step off at most.
        ks, vs = kwargs["k_scale"], kwargs["v_scale"]
        top = torch.finfo(c.cache_dtype).max
        rel, tiny = (2**-4, 2**-10) if c.cache_dtype == torch.float8_e4m3fn else (2**-3, 2**-17)
        for cache, ref_cache, src, scale in ((kc, kc_ref, k_rot, ks), (vc, vc_ref, v, vs)):
            scale = torch.as_tensor(scale, device=DEVICE, dtype=torch.float32).reshape(-1, 1)
            deq = rows(cache).float() * scale
            exact = (src[valid].float() / scale).clamp(-top, top) * scale
            assert ((deq - exact).abs() <= rel * exact.abs() + tiny * scale).all()
            same = (rows(cache).view(torch.uint8) == rows(ref_cache).view(torch.uint8))
            assert same.float().mean() >= 0.99
    untouched = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots[valid].long()] = False
    ub, uo = untouched.nonzero()[:, 0] // bs, untouched.nonzero()[:, 0] % bs
    urows = (lambda cache: cache[ub, uo]) if c.layout == "NHD" else (
        lambda cache: cache[ub, :, uo])
    for cache, before in ((kc, kc0), (vc, vc0)):
        assert torch.equal(urows(cache).view(torch.uint8), urows(before).view(torch.uint8))


PAGED_CASES = {
    "nhd_neox": PCase(),
    "hnd_neox": PCase(layout="HND"),
    "nhd_gptj": PCase(style="gptj"),
    "hnd_gptj_partial": PCase(layout="HND", style="gptj", rotary_dim=48),
    "neox_partial": PCase(rotary_dim=32, D=128, Hq=8, Hkv=2),
    "packed_qkv_shared_kv_cache": PCase(packed=True, shared_kv=True, layout="HND"),
    "fp16_int32": PCase(dtype=torch.float16, index_dtype=torch.int32),
    "gemma_offset": PCase(offset=1.0),
    "hf_rounding": PCase(norm_rounding="hf", style="gptj"),
    "head_dim_512": PCase(D=512, Hq=2, Hkv=1, T=5, num_blocks=2, block_size=4),
    "head_dim_256_gqa4": PCase(D=256, Hq=8, Hkv=2, T=7),
    "fp8_per_tensor": PCase(cache_dtype=torch.float8_e4m3fn),
    "fp8_per_head_hnd": PCase(cache_dtype=torch.float8_e4m3fn, per_head_scale=True,
                              layout="HND"),
    "e5m2_per_tensor": PCase(cache_dtype=torch.float8_e5m2),
    "e5m2_per_head_hnd": PCase(cache_dtype=torch.float8_e5m2, per_head_scale=True,
                               layout="HND"),
    "yarn_cos_sin_scale": PCase(cos_sin_scale=1.1386, D=128, Hq=4, Hkv=2),
    "mrope_interleaved": PCase(mrope="interleaved", D=128, Hq=4, Hkv=2),
    "mrope_contiguous_hnd": PCase(mrope="contiguous", layout="HND"),
    "qwen35_gated_partial_offset": PCase(D=256, Hq=4, Hkv=2, T=6, rotary_dim=64, offset=1.0,
                                         mrope="interleaved"),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_matches_reference(name):
    check(PAGED_CASES[name])


def test_per_sequence_contiguous_cache_is_hnd_with_block_size_L():
    # A decode batch whose sequences sit at different positions, written into a contiguous
    # [B, Hkv, L, D] cache: HND with block_size L and slot b * L + row.
    B, Hq, Hkv, D, L = 3, 4, 2, 64, 16
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(B, H, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
               for H in (Hq, Hkv, Hkv))
    rows = torch.tensor([3, 15, 7], device=DEVICE)
    kc = torch.randn(B, Hkv, L, D, generator=g, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    qw = torch.ones(D, device=DEVICE, dtype=torch.bfloat16)
    inv = rope_inv_freq(D, 1e6, DEVICE)
    slots = torch.arange(B, device=DEVICE) * L + rows
    _, k_rot = qkrope.fused_qk_norm_rope_paged(q, k, v, rows, kc, vc, slots, qw, qw, inv, 1e-6,
                                               cache_layout="HND")
    for b in range(B):
        assert torch.equal(kc[b, :, rows[b]], k_rot[b]) and torch.equal(vc[b, :, rows[b]], v[b])


def bad(**changes):
    args, kwargs = make(PCase())
    names = ["query", "key", "value", "positions", "key_cache", "value_cache", "slot_mapping",
             "q_norm_weight", "k_norm_weight", "inv_freq", "rms_norm_eps"]
    a = dict(zip(names, args))
    for n, f in changes.items():
        if n in a:
            a[n] = f(a[n]) if callable(f) else f
        else:
            kwargs[n] = f
    return [a[n] for n in names], kwargs


@pytest.mark.parametrize("change, exc, words", [
    (dict(rotary_dim=33), ValueError, ["rotary_dim", "even"]),
    (dict(rotary_dim=128), ValueError, ["rotary_dim", "head_dim=64"]),
    (dict(inv_freq=lambda x: x[:5]), ValueError, ["inv_freq", "rotary_dim/2"]),
    (dict(cache_layout="NDH"), ValueError, ["cache_layout", "NHD"]),
    (dict(rotary_style="llama"), ValueError, ["rotary_style", "gptj"]),
    (dict(value_cache=lambda x: x[:2]), ValueError, ["value_cache", "shape of key_cache"]),
    (dict(key_cache=lambda x: x[:, :, :1]), ValueError, ["key_cache", "Hkv"]),
    (dict(slot_mapping=lambda x: x[:3]), ValueError, ["slot_mapping", "[T]"]),
    (dict(positions=lambda x: x.float()), TypeError, ["positions", "int32 or int64"]),
    (dict(k_scale=0.5), ValueError, ["k_scale", "float8_e4m3fn"]),
    (dict(norm_weight_offset=1.0, norm_rounding="hf"), ValueError, ["norm_weight_offset"]),
    (dict(query=lambda x: x[..., :48], key=lambda x: x[..., :48], value=lambda x: x[..., :48]),
     ValueError, ["head_dim", "512"]),
    # Scalars the kernel uses in float32: finite in float64 is not enough (1e39 is inf there:
    # all-NaN outputs; 1e-46 is 0: all-zero outputs), nor is a float32 subnormal.
    (dict(cos_sin_scale=1e39), ValueError, ["cos_sin_scale", "float32", "inf"]),
    (dict(cos_sin_scale=1e-46), ValueError, ["cos_sin_scale", "float32", "is 0"]),
    (dict(cos_sin_scale=1e-40), ValueError, ["cos_sin_scale", "subnormal"]),
    (dict(norm_weight_offset=1e39), ValueError, ["norm_weight_offset", "float32"]),
    (dict(norm_weight_offset=-1e-40), ValueError, ["norm_weight_offset", "subnormal"]),
    (dict(rms_norm_eps=1e39), ValueError, ["rms_norm_eps", "float32"]),
    (dict(rms_norm_eps=1e-40), ValueError, ["rms_norm_eps", "subnormal"]),
    (dict(key_cache=lambda x: x.to(torch.float8_e4m3fn),
          value_cache=lambda x: x.to(torch.float8_e4m3fn), k_scale=1e39, v_scale=0.5),
     ValueError, ["k_scale", "float32", "inf"]),
    (dict(key_cache=lambda x: x.to(torch.float8_e4m3fn),
          value_cache=lambda x: x.to(torch.float8_e4m3fn), k_scale=0.5, v_scale=1e-46),
     ValueError, ["v_scale", "float32", "is 0"]),
    # Negative-bit views read as the negation of the memory the kernel addresses.
    (dict(key=lambda x: torch._neg_view(x.neg())), ValueError, ["key is a negative-bit view"]),
    (dict(value_cache=lambda x: torch._neg_view(x)), ValueError,
     ["value_cache is a negative-bit view", "resolve_neg"]),
    (dict(key_cache=lambda x: x.to(torch.float8_e4m3fn),
          value_cache=lambda x: x.to(torch.float8_e4m3fn),
          k_scale=torch._neg_view(torch.tensor([-0.5], device=DEVICE)), v_scale=0.5),
     ValueError, ["k_scale is a negative-bit view"]),
    # mrope_interleaved alone would silently run plain RoPE.
    (dict(mrope_interleaved=True), ValueError, ["mrope_interleaved=True needs mrope_section"]),
])
def test_bad_arguments_are_named(change, exc, words):
    args, kwargs = bad(**change)
    with pytest.raises(exc) as info:
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_numpy_bool_option_is_named_with_its_type():
    np = pytest.importorskip("numpy")
    args, kwargs = bad(mrope_interleaved=np.bool_(True))
    with pytest.raises(TypeError, match=r"mrope_interleaved must be a Python bool \(True or "
                                        r"False\), got np.True_ of type numpy.bool"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)


def test_packed_entry_point_names_an_empty_q_norm_weight():
    # It has no head_dim argument: D comes from q_norm_weight, so the error names that.
    c = PCase(packed=True)
    args, kwargs = make(c)
    qkv = args[0].view(c.T, -1)._base
    empty = args[7][:0]
    with pytest.raises(ValueError) as info:
        qkrope.fused_qkv_norm_rope_paged(qkv, c.Hq, c.Hkv, *args[3:7], empty, *args[8:],
                                         **kwargs)
    assert str(info.value).startswith("q_norm_weight must have shape [D] with D >= 1")
    assert "head_dim must" not in str(info.value)
    with pytest.raises(ValueError, match=r"the length of q_norm_weight\), got \[11, 512\]"):
        qkrope.fused_qkv_norm_rope_paged(qkv, c.Hq, c.Hkv, *args[3:7], args[7][:32],
                                         *args[8:], **kwargs)


def test_fp8_cache_requires_scale():
    args, kwargs = make(PCase(cache_dtype=torch.float8_e4m3fn))
    kwargs.pop("k_scale")
    with pytest.raises(ValueError, match="k_scale is required"):
        qkrope.fused_qk_norm_rope_paged(*args, **kwargs)


# bf16 bit patterns of values whose FP8 codes are easy to get wrong: +-0, tiny values that round
# to +-0 after the scale, NaN of either sign, +-inf, normals, bf16 subnormals.
_SPECIAL_BF16 = (0x0000, 0x8000, 0xB8D2, 0x38D2, 0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x3F80, 0xC040,
                 0x43FA, 0x8DA2, 0x0001, 0x8001, 0x3C00, 0x3A00, 0x0040, 0x806B, 0x000B)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("scale", [0.0, -0.0, -0.025, float("nan"), -float("nan"), float("inf"),
                                   1e-40, -1e-40, 0.025],
                         ids=["zero", "neg_zero", "negative", "nan", "neg_nan", "inf",
                              "subnormal", "neg_subnormal", "normal"])
def test_fp8_cache_bytes_match_the_oracle_for_every_scale_value(scale, per_head, dtype):
    # Without validate a scale tensor's values are not checked (that would cost a host sync):
    # whatever they hold, the cache bytes are the oracle's, bit for bit. V's rows go to the
    # cache unchanged, so they compare whole; the rotated K rows compare through the kernel's
    # own key_rotated (a flipped rounding in K would otherwise be a different byte).
    from qkrope.ops.qknorm_rope.reference import quantize

    c = PCase(T=5, cache_dtype=dtype, per_head_scale=per_head, seed=11)
    args, kwargs = make(c)
    special = torch.tensor(_SPECIAL_BF16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v, slots = args[2].clone(), args[6].long()
    t = int(((slots >= 0) & (slots < c.num_blocks * c.block_size)).nonzero()[0])
    assert t != 2  # the specials go to the first token whose row is written
    v[t].view(-1)[: 4 * special.numel()] = special.repeat(4).to(DEVICE)
    v[2, 0, :8] = -1e-6  # rounds to -0 at any scale below ~500
    args = (*args[:2], v, *args[3:])
    bad = torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    for name in ("k_scale", "v_scale"):
        if per_head:  # head 0 keeps a valid scale, head 1 gets the odd one
            kwargs[name] = torch.stack((kwargs[name][0], bad))
        else:
            kwargs[name] = bad.reshape(1)
    _, _, kc_ref, vc_ref = qkrope.reference_paged(*args, **kwargs)
    _, k_rot = qkrope.fused_qk_norm_rope_paged(*args, **kwargs)
    kc, vc = args[4], args[5]
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8)), "value cache bytes"
    valid = (slots >= 0) & (slots < c.num_blocks * c.block_size)
    blk, off = slots[valid] // c.block_size, slots[valid] % c.block_size
    want = quantize(k_rot[valid], kc.dtype, kwargs["k_scale"], 1)
    assert torch.equal(kc[blk, off].view(torch.uint8), want.view(torch.uint8)), "key cache bytes"
    assert (vc_ref.view(torch.uint8) != 0xFF).all(), "NaN must be stored as 0x7F, not 0xFF"


def test_packed_entry_point_matches_views():
    c = PCase(packed=True)
    args, kwargs = make(c)
    q, k, v = args[:3]
    qkv = q.view(c.T, -1)._base if q._base is not None else None
    assert qkv is not None and qkv.shape == (c.T, (c.Hq + 2 * c.Hkv) * c.D)
    kc2, vc2 = args[4].clone(), args[5].clone()
    a = qkrope.fused_qkv_norm_rope_paged(qkv, c.Hq, c.Hkv, *args[3:], **kwargs)
    b = qkrope.fused_qk_norm_rope_paged(q, k, v, args[3], kc2, vc2, *args[6:], **kwargs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(args[4], kc2) and torch.equal(args[5], vc2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    PCase(T=1000, Hq=32, Hkv=8, D=128, num_blocks=256, block_size=16),
    PCase(T=777, Hq=96, Hkv=8, D=128, num_blocks=64, block_size=16, layout="HND", packed=True),
    PCase(T=300, Hq=16, Hkv=4, D=256, num_blocks=32, block_size=16, style="gptj",
          rotary_dim=64, cache_dtype=torch.float8_e4m3fn, per_head_scale=True),
    PCase(T=64, Hq=8, Hkv=8, D=512, num_blocks=8, block_size=16, offset=1.0),
], ids=["nhd-32-8", "hnd-96-8-packed", "fp8-gptj-partial-d256", "d512-gemma"])
def test_paged_large_shapes(case):
    check(case)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    T=st.integers(3, 24),
    Hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 4]),
    D=st.sampled_from([64, 128]),
    layout=st.sampled_from(["NHD", "HND"]),
    style=st.sampled_from(["neox", "gptj"]),
    partial=st.booleans(),
    packed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_random_configurations(T, Hkv, group, D, layout, style, partial, packed, seed):
    check(PCase(T=T, Hq=Hkv * group, Hkv=Hkv, D=D, layout=layout, style=style,
                rotary_dim=D // 2 if partial else None, packed=packed, seed=seed,
                num_blocks=(T + 7) // 4 + 1, block_size=4))


# --------------------------------------------------------------------------------------------
# [B, H, S, D] entry point
# --------------------------------------------------------------------------------------------
BHSD_CASES = {
    "basic": Case(),
    "prime_S_B3": Case(B=3, S=37, Hq=4, Hkv=4),
    "gqa4_d128": Case(B=2, Hq=8, Hkv=2, S=13, D=128, L=40),
    "gqa1_d256": Case(B=1, Hq=2, Hkv=2, S=5, D=256, L=9),
    "fp16": Case(dtype=torch.float16, S=11, Hq=4, Hkv=1),
    "int32_indices": Case(index_dtype=torch.int32, S=9),
    "noncontig_packed_qkv": Case(noncontig=True, B=2, Hq=4, Hkv=2, S=17, D=64, L=24),
    "per_batch_positions": Case(B=3, per_batch_pos=True, expand_pos=False, S=6),
    "padding_and_out_of_range_rows": Case(S=10, L=16, pad_rows=(0, 4), far_rows=(7, 9)),
    "last_cache_slot": Case(S=4, L=12, start=8),
    "decode_S1": Case(B=3, S=1, Hq=8, Hkv=2, D=128, L=64, start=63),
    "large_positions": Case(B=2, S=19, max_pos=2**18, per_batch_pos=True, expand_pos=False),
}


@pytest.mark.parametrize("name", list(BHSD_CASES))
def test_fused_matches_reference(name):
    run_and_check(make_inputs(BHSD_CASES[name]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_norm_rounding(dtype):
    run_and_check(make_inputs(Case(S=9, dtype=dtype, seed=11)), norm_rounding="hf")


def test_default_allocation_and_no_mutation_mode():
    args = make_inputs(Case(S=9))
    kc, vc = args[4], args[5]
    kc0, vc0 = kc.clone(), vc.clone()
    q_rot, k_rot, kc_new, vc_new = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(
        *args, inplace=False)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "inplace=False mutated the caches"
    assert kc_new.data_ptr() != kc.data_ptr() and vc_new.data_ptr() != vc.data_ptr()
    ref = qkrope.reference(*args, inplace=False)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    for out, r in zip((kc_new, vc_new), ref[2:]):
        assert torch.equal(out, r)
    torch.testing.assert_close(q_rot, ref[0], rtol=0, atol=0.05)


def _within_ulps(got, want, ulps):
    """Equal (+0 and -0 alike), or (a flip of one rounding upstream) at most ``ulps`` steps of
    the bf16/fp16 grid apart with the same sign; NaN nowhere."""
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    return not torch.isnan(got).any() and bool(((got == want) | ((a - b).abs() <= ulps)).all())


@pytest.mark.parametrize("options", [{}, dict(norm_rounding="hf"),
                                     dict(rotary_dim=32, norm_weight_offset=1.0),
                                     dict(rotary_style="gptj")],
                         ids=["default", "hf", "partial_offset", "gptj"])
def test_subnormal_rows_and_weights_match_the_oracle(options):
    """bf16 subnormals in query rows (loaded), in K's norm weights (the outputs subnormal:
    stored) and in V (copied) go through like any other value. Triton's interpreter converts
    them wrongly between bf16 and fp32 (docs/design.md, "Interpreter bf16 casts")."""
    args = list(make_inputs(Case(B=1, Hq=2, Hkv=1, S=3, D=64, L=8, seed=5)))
    tiny = 2.0 ** -131
    args[0], args[2], args[8] = args[0] * tiny, args[2] * tiny, args[8] * tiny
    assert (args[0].abs() < 2.0 ** -126).all() and (args[8].abs() < 2.0 ** -126).all()
    if "rotary_dim" in options:
        args[9] = rope_inv_freq(options["rotary_dim"], 1e7).to(DEVICE)
    kc, vc = args[4].clone(), args[5].clone()
    outs = qkrope.run(*args[:4], kc, vc, *args[6:], query_out=poisoned_like(args[0]),
                      key_out=poisoned_like(args[1]), **options)
    want = qkrope.reference(*args, inplace=False, **options)
    for name, got, ref in zip(("query_rotated", "key_rotated"), outs, want):
        assert (got == ref).float().mean() >= 0.99 and _within_ulps(got, ref, 2), name
    if not options.get("norm_weight_offset"):  # (1 + w: normal weights, normal outputs)
        assert (outs[1].abs() < 2.0 ** -126).all() and (outs[1] != 0).any()
    rows, untouched = args[6], torch.ones(kc.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[rows] = False
    assert torch.equal(kc[:, :, rows], outs[1]) and torch.equal(vc[:, :, rows], args[2])
    assert torch.equal(kc[:, :, untouched], args[4][:, :, untouched])
    assert torch.equal(vc[:, :, untouched], args[5][:, :, untouched])


def test_query_out_may_alias_query():
    args = make_inputs(Case(S=8))
    expected = qkrope.reference(*args, inplace=False)[0]
    query = args[0].clone()
    out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(query, *args[1:], query_out=query)[0]
    assert out is query
    assert (out == expected).float().mean() > 0.99


def test_strided_query_out():
    args = make_inputs(Case(S=6))
    big = torch.full((2, 6, 4, 64 * 2), float("nan"), dtype=args[0].dtype, device=DEVICE)
    q_out = big[..., :64].transpose(1, 2)  # [B, Hq, S, D], non-contiguous
    out = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args, query_out=q_out)[0]
    assert out is q_out and not torch.isnan(q_out).any()
    assert torch.isnan(big[..., 64:]).all(), "wrote outside the query_out view"


def test_repeated_cache_position_writes_one_of_the_tokens_per_element():
    # Documented contract: each element of a repeated row holds that element of one of the
    # tokens naming it (programs race, so tokens may mix within the row); other rows untouched.
    args = list(make_inputs(Case(S=4, L=8)))
    args[6] = torch.tensor([5, 5, 2, 5], dtype=torch.int64, device=DEVICE)
    kc0, vc0 = args[4].clone(), args[5].clone()
    _, k_rot, kc, vc = qkrope.fused_rope_with_qk_norm_and_kv_cache_update(*args)
    for cache, new in ((kc, k_rot), (vc, args[2])):
        candidates = new[:, :, [0, 1, 3]]                      # [B, H, 3, D]
        assert (cache[:, :, 5:6] == candidates).any(dim=2).all()
        assert torch.equal(cache[:, :, 2], new[:, :, 2])
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(kc[:, :, untouched], kc0[:, :, untouched])
    assert torch.equal(vc[:, :, untouched], vc0[:, :, untouched])


def test_benchmark_all_ones_weights():
    args = list(make_inputs(Case(S=5)))
    args[7] = torch.ones_like(args[7])
    args[8] = torch.ones_like(args[8])
    run_and_check(tuple(args))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    B=st.integers(1, 3),
    Hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    S=st.integers(1, 40),
    D=st.sampled_from([64, 128]),
    extra_rows=st.integers(0, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    noncontig=st.booleans(),
    seed=st.integers(0, 2**16),
)
# One 64-wide fp16 head whose key has one element an ulp from the reference's (within the bound).
@example(B=1, Hkv=1, group=1, S=1, D=64, extra_rows=5, dtype=torch.float16, noncontig=False,
         seed=14952)
def test_fused_matches_reference_random_shapes(B, Hkv, group, S, D, extra_rows, dtype,
                                               noncontig, seed):
    # The new rows end at the last cache slot.
    c = Case(B=B, Hq=Hkv * group, Hkv=Hkv, S=S, D=D, L=S + 3 + extra_rows, dtype=dtype,
             noncontig=noncontig, start=3 + extra_rows, seed=seed, max_pos=2**18)
    run_and_check(make_inputs(c))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is turned on only without CUDA")
def test_kernels_run_when_triton_was_imported_before_qkrope():
    # transformers (through torch._inductor) imports triton before a user imports qkrope; the
    # interpreter is then enabled after triton.language exists, and the kernels must still run.
    import os
    import subprocess
    import sys

    code = (
        "import triton.language, torch, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "import qkrope\n"
        "from helpers import Case, make_inputs, run_and_check\n"
        "run_and_check(make_inputs(Case(S=3)))\n"
        "from test_qknorm_rope import PCase, check\n"
        "check(PCase(T=4))\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=root, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


BHSD_VARIANTS = {
    "gptj": dict(rotary_style="gptj"),
    "partial_neox": dict(rotary_dim=32),
    "gemma_offset": dict(norm_weight_offset=1.0),
    "yarn_cos_sin_scale": dict(cos_sin_scale=1.1386),
    "mrope_interleaved": dict(mrope="interleaved"),
    "mrope_contiguous_partial": dict(mrope="contiguous", rotary_dim=32),
    "fp8_per_head": dict(fp8="per_head"),
    "fp8_per_tensor_hf": dict(fp8="per_tensor", norm_rounding="hf"),
    "e5m2_per_head": dict(fp8="per_head", fp8_dtype=torch.float8_e5m2),
}


@pytest.mark.parametrize("name", list(BHSD_VARIANTS))
def test_bhsd_entry_point_has_every_variant(name):
    """The [B, H, S, D] entry point runs the same kernel: every paged-op feature works there."""
    kw = dict(BHSD_VARIANTS[name])
    c = Case(B=2, Hq=4, Hkv=2, S=7, D=64, L=16, noncontig=True, pad_rows=(1,), seed=11)
    args = list(make_inputs(c))
    mrope, fp8 = kw.pop("mrope", None), kw.pop("fp8", None)
    fp8_dtype = kw.pop("fp8_dtype", torch.float8_e4m3fn)
    rot = kw.get("rotary_dim") or c.D
    if rot != c.D:
        args[9] = rope_inv_freq(rot, 1e6, DEVICE)
    if mrope:
        kw.update(mrope_kwargs(mrope, rot))
        args[3] = three_streams(args[3].expand(c.B, c.S).contiguous(), None)
    if fp8:
        args[4], args[5] = args[4].to(fp8_dtype), args[5].to(fp8_dtype)
        kw.update(k_scale=0.03 if fp8 == "per_tensor" else torch.tensor([0.02, 0.04],
                                                                          device=DEVICE),
                  v_scale=0.015)
    kc0, vc0 = args[4].clone(), args[5].clone()
    q_out, k_out = torch.full_like(args[0], float("nan")), torch.full_like(args[1], float("nan"))
    q_rot, k_rot, kc, vc = qkrope.run(*args, **kw, query_out=q_out, key_out=k_out)
    assert q_rot is q_out and kc is args[4]
    rq, rk, kc_ref, vc_ref = qkrope.reference(*args[:4], kc0, vc0, *args[6:], **kw)
    check_rotated(((q_rot, rq, args[0], args[7]), (k_rot, rk, args[1], args[8])), args[10], c.D,
                  rot, kw.get("rotary_style", "neox"), kw.get("norm_weight_offset", 0.0),
                  kw.get("norm_rounding", "weight_fp32"), kw.get("cos_sin_scale", 1.0))
    same = (kc.view(torch.uint8) == kc_ref.view(torch.uint8)).float().mean()
    assert same >= 0.99 and torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    keep = torch.ones(c.L, dtype=torch.bool, device=DEVICE)
    keep[args[6][args[6] >= 0].long()] = False
    assert torch.equal(kc[:, :, keep].view(torch.uint8), kc0[:, :, keep].view(torch.uint8))
