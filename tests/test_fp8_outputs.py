"""FP8 query / key outputs (``query_out`` / ``key_out`` of float8_e4m3fn or float8_e5m2 with
``q_scale`` / ``k_scale``): the kernel stores exactly ``saturate(rotated_row / scale)`` of the
rotated row it computes in the activation dtype (spec.md R4), through both entry points, per
tensor and per head, next to bf16 or FP8 caches; special values; the store's rounding for every
bf16 value; refusals by name. CPU: the real kernel in Triton's interpreter."""

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICE, Case, division_check, make_inputs
from test_qknorm_rope import PCase, make

import qkrope
from qkrope._interpret import interpreting
from qkrope.ops.qknorm_rope.kernel import _store_scaled
from qkrope.ops.qknorm_rope.launcher import saturating_fp8_cvt
from qkrope.ops.qknorm_rope.quantize import _store_fp8
from qkrope.ops.qknorm_rope.reference import quantize


FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def bhsd_call(case_kw=None, **kw):
    args = make_inputs(Case(**(case_kw or {})))
    return qkrope.fused_rope_with_qk_norm_and_kv_cache_update, args, kw


def paged_call(cache_dtype=None, **kw):
    args, kwargs = make(PCase(cache_dtype=cache_dtype, per_head_scale=True, seed=3))
    return qkrope.fused_qk_norm_rope_paged, args, {**kwargs, **kw}


def fresh(args):
    """The arguments with caches of their own (each run writes its caches)."""
    return (*args[:4], args[4].clone(), args[5].clone(), *args[6:])


def per(kind, n, base):
    if kind.endswith("-pow2"):  # a power of two, as engines' default 1.0 (per head: 1-n times it)
        kind, base = kind[:-len("-pow2")], 2.0**-8
    if kind == "float":
        return base
    if kind == "tensor":
        return torch.tensor([base], device=DEVICE)
    return base * (1 + torch.arange(n, device=DEVICE, dtype=torch.float32))  # per head


def fp8_like(x, dtype=FP8):
    return torch.full(x.shape, float("nan"), device=x.device).to(dtype)  # poisoned


@pytest.mark.parametrize("entry, kind, out_dtype", [
    *((e, k, FP8) for e in ("bhsd", "paged-bf16-cache", "paged-fp8-cache")
      for k in ("float", "tensor", "per-head")),
    ("bhsd", "per-head", E5M2), ("paged-e5m2-cache", "float", E5M2),
    ("paged-fp8-cache", "tensor", E5M2), ("bhsd", "float-pow2", FP8),
    ("paged-bf16-cache", "tensor-pow2", E5M2), ("bhsd", "per-head-pow2", FP8)])
def test_fp8_outputs_are_the_rotated_rows_quantised(entry, kind, out_dtype):
    if entry == "bhsd":
        op, args, kw = bhsd_call()
    else:
        op, args, kw = paged_call({"paged-fp8-cache": FP8, "paged-e5m2-cache": E5M2}.get(entry))
    q, k = args[0], args[1]
    Hq, Hkv = q.shape[1], k.shape[1]
    q_scale = per(kind, Hq, 0.004)
    k_scale = kw.get("k_scale", per(kind, Hkv, 0.006))
    plain = fresh(args)
    q_bf, k_bf = op(*plain, **kw)[:2]  # the rotated rows in the activation dtype
    quant = fresh(args)
    q8, k8 = fp8_like(q, out_dtype), fp8_like(k, out_dtype)
    out = op(*quant, **{**kw, "k_scale": k_scale}, q_scale=q_scale, query_out=q8, key_out=k8)
    assert out[0] is q8 and out[1] is k8
    want_q = quantize(q_bf, out_dtype, q_scale, 1)
    want_k = quantize(k_bf, out_dtype, k_scale, 1)
    assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))
    # The caches are written as without quantised outputs.
    for a, b in ((plain[4], quant[4]), (plain[5], quant[5])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # And the oracle, given the same outputs, stores the same codes but for the rare element
    # where the kernel's last-ulp trig/rsqrt (README, "Numerics") moves a bf16 rounding.
    oracle = qkrope.reference if entry == "bhsd" else qkrope.reference_paged
    r8q, r8k = fp8_like(q, out_dtype), fp8_like(k, out_dtype)
    oracle(*args, **{**kw, "k_scale": k_scale}, q_scale=q_scale, query_out=r8q, key_out=r8k)
    for got, ref in ((q8, r8q), (k8, r8k)):
        assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean() >= 0.99


@pytest.mark.parametrize("dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_outputs_of_zero_nan_inf_and_huge_rows(dtype):
    op, args, kw = bhsd_call(dict(B=1, Hq=4, Hkv=2, S=3))
    q = args[0].clone()
    q[0, 0, 0] = 0                      # a row of zeros: 0 / rms (eps) stays 0
    q[0, 1, 1, 5] = float("nan")        # NaN anywhere in the row: the whole row is NaN
    q[0, 2, 2, 7] = float("inf")        # inf: rsqrt(inf) = 0, so inf * 0 = NaN there, 0 else
    args = (q, *args[1:])
    # head 3 saturates (e5m2 from 57344: a smaller scale)
    q_scale = torch.tensor([0.01, 0.01, 0.01, 1e-6 if dtype == FP8 else 1e-9], device=DEVICE)
    q8 = fp8_like(q, dtype)
    op(*fresh(args), q_scale=q_scale, query_out=q8)
    codes = q8.view(torch.uint8)
    assert ((codes[0, 0, 0] & 0x7F) == 0).all()          # +-0 (as the rotation signs it)
    assert (codes[0, 1, 1] == 0x7F).all()
    q_bf = op(*fresh(args))[0]
    inf_row = q_bf[0, 2, 2].float()
    assert inf_row.isnan().any() and torch.equal(codes[0, 2, 2] == 0x7F, inf_row.isnan())
    assert ((codes[0, 2, 2][~inf_row.isnan()] & 0x7F) == 0).all()
    sat = q8[0, 3].float()
    top = torch.finfo(dtype).max                          # never inf: saturated
    assert (sat.abs() == top).float().mean() > 0.9       # all but rows' near-zero elements
    assert torch.equal(codes, quantize(q_bf, dtype, q_scale, 1).view(torch.uint8))


def test_skipped_rows_leave_the_caches_but_every_output_is_written():
    op, args, kw = bhsd_call(dict(pad_rows=(0,), far_rows=(2,)))
    run = fresh(args)
    q8 = fp8_like(args[0])
    op(*run, q_scale=0.01, query_out=q8)
    assert not q8.float().isnan().any()                  # every poisoned element overwritten
    for t in (0, 2):                                     # -1 and >= L: nothing written
        row = int(args[6][t])
        if 0 <= row < args[4].shape[2]:
            assert torch.equal(run[4][:, :, row], args[4][:, :, row])
    ref = qkrope.reference(*args, inplace=False)
    assert torch.equal(run[4], ref[2]) and torch.equal(run[5], ref[3])


def test_fp8_outputs_under_torch_compile_equal_eager():
    op, args, _ = bhsd_call(dict(S=3, seed=4))
    eager_q8, comp_q8 = fp8_like(args[0]), fp8_like(args[0])
    op(*fresh(args), q_scale=0.01, query_out=eager_q8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, out: op(*a, q_scale=0.01, query_out=out),
                             fullgraph=True)
    compiled(*fresh(args), out=comp_q8)
    assert torch.equal(eager_q8.view(torch.uint8), comp_q8.view(torch.uint8))


@pytest.mark.parametrize("call, error, words", [
    (dict(q_scale=0.01), ValueError,
     "q_scale is only used with a float8_e4m3fn or float8_e5m2 query_out"),
    (dict(query_out="fp8"), ValueError,
     "q_scale is required for a float8_e4m3fn or float8_e5m2 query_out"),
    (dict(key_out="fp8"), ValueError,
     "k_scale is required for a float8_e4m3fn or float8_e5m2 key_out"),
    (dict(k_scale=0.01), ValueError,
     "k_scale is only used with a float8_e4m3fn or float8_e5m2 key_cache or key_out"),
    (dict(query_out="fp8", q_scale=torch.ones(3)), ValueError, "1 or Hq=4"),
    (dict(query_out="fp8", q_scale=-1.0), ValueError, "q_scale must be finite and > 0"),
    (dict(query_out="fp8", q_scale=torch.ones(1, dtype=torch.float64)), TypeError, "q_scale"),
    (dict(query_out="float32"), TypeError,
     "query_out must be bfloat16, float8_e4m3fn or float8_e5m2"),
])
def test_quantised_output_arguments_are_checked_by_name(call, error, words):
    op, args, _ = bhsd_call()
    kw = dict(call)
    for name, like in (("query_out", args[0]), ("key_out", args[1])):
        if kw.get(name) == "fp8":
            kw[name] = fp8_like(like)
        elif kw.get(name) == "float32":
            kw[name] = torch.empty(like.shape, device=DEVICE)
    if isinstance(kw.get("q_scale"), torch.Tensor):
        kw["q_scale"] = kw["q_scale"].to(DEVICE)
    kc = args[4].clone()
    with pytest.raises(error, match=words):
        op(*args, **kw)
    assert torch.equal(args[4], kc), "a refused call wrote the cache"


def test_validate_names_a_bad_q_scale_value():
    op, args, _ = bhsd_call()
    with pytest.raises(ValueError, match="q_scale holds nan"):
        op(*fresh(args), query_out=fp8_like(args[0]), validate=True,
           q_scale=torch.tensor([float("nan")], device=DEVICE))


@triton.jit
def _store_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, INTERPRETER: tl.constexpr,
                  SAT_CVT: tl.constexpr):
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + off, mask=off < n, other=0.0)
    _store_fp8(out_ptr, off, v, off < n, INTERPRETER, SAT_CVT)


@pytest.mark.parametrize("sat_cvt", [False, True], ids=["clamp", "satfinite"])
@pytest.mark.parametrize("dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_store_rounds_every_bf16_value_as_the_oracle(dtype, sat_cvt):
    """The kernel's FP8 store (``quantize._store_fp8``: saturate, nearest even, NaN as 0x7F; in
    the interpreter its own rounding of the fp32 bits, on a GPU the hardware conversion, with
    the explicit clamp or, ``satfinite``, the conversion's own saturation) against the oracle's
    (clamp + torch's cast), for every bf16 bit pattern, values between them, and values around
    either dtype's largest and subnormal steps."""
    if sat_cvt and not saturating_fp8_cvt(torch.empty(0, device=DEVICE).device):
        pytest.skip("the saturating conversion needs a GPU of compute capability 8.9 on")
    bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    edges = torch.tensor([448.0, 464.0, 480.0, 57344.0, 57343.9, 61439.9, 61440.0, 2.0**-9,
                          2.0**-10, 1.5 * 2**-10, 2.0**-16, 2.0**-17, 1.5 * 2**-17, 2.5 * 2**-16])
    x = torch.cat((bf16, bf16 * (1 + 2**-9), edges, -edges)).to(DEVICE)
    out = torch.empty(x.numel(), dtype=dtype, device=DEVICE)
    block = 32768
    _store_kernel[(triton.cdiv(x.numel(), block),)](
        x, out, x.numel(), BLOCK=block, INTERPRETER=interpreting(),
        SAT_CVT=sat_cvt)
    want = quantize(x, dtype, 1.0, 0).view(torch.uint8)
    got = out.view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:8]


@triton.jit
def _scaled_store_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr,
                         INTERPRETER: tl.constexpr, SAT_CVT: tl.constexpr):
    off = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + off, mask=off < n, other=0.0)
    scale = tl.load(scale_ptr + tl.program_id(1))
    _store_scaled(out_ptr, tl.program_id(1).to(tl.int64) * n + off, v, off < n, scale, True,
                  INTERPRETER, SAT_CVT)


@pytest.mark.parametrize("dtype", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_static_scale_store_of_every_bf16_value_is_the_oracles(dtype):
    """``kernel._store_scaled`` itself (on a GPU its select-free FMA quotient, in the
    interpreter ``div_rn``) against the oracle's ``x / s`` bytes, for every bf16 bit pattern
    (-0, subnormals, +-inf and NaN included) and every kind of scale value a scale tensor may
    hold unchecked (``fp8_division_check.scales``: +-0, negative, +-inf, NaN, subnormal of
    either sign, huge, and random ones): signed zeros and saturation included, byte for
    byte."""
    ss = torch.from_numpy(division_check().scales(8, seed=5)).to(DEVICE)
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(DEVICE)
    out = torch.empty(ss.numel(), x.numel(), dtype=dtype, device=DEVICE)
    block = 32768
    _scaled_store_kernel[(triton.cdiv(x.numel(), block), ss.numel())](
        x, ss, out, x.numel(), BLOCK=block, INTERPRETER=interpreting(),
        SAT_CVT=saturating_fp8_cvt(x.device))
    want = quantize(x.expand(ss.numel(), -1), dtype, ss, 0).view(torch.uint8)
    got = out.view(torch.uint8)
    bad = (got != want).nonzero()
    assert not len(bad), [(ss[i].item(), x[j].item()) for i, j in bad[:8].tolist()]


def test_static_scale_quotient_gives_the_ieee_quotients_codes():
    """The kernel's static-scale quotient on a GPU (``kernel._store_scaled``: the head's
    reciprocal and one FMA correction; the interpreter keeps ``div_rn``) stores the same e4m3
    and e5m2 codes as torch's ``x / s`` for every bf16 and fp16 ``x`` on a few scales (the full
    check: ``python benchmarks/fp8_division_check.py``), and the check has teeth: the quotient
    without its FMA correction is caught."""
    check = division_check()
    assert check.main(["--scales", "4"]) == 0
    check.kernel_quotient = lambda x, s: (x.astype(check.F64) * check.F64(
        check.F32(1.0 / check.F64(s)))).astype(check.F32)
    assert check.main(["--scales", "40"]) == 1
