"""Triton helpers of the kernel's quantised stores: FP8 (e4m3, e5m2) and INT8 codes, and the
per-token-head scale of a written row (docs/design.md, "FP8 stores", "Per-token-head
scales"). Every quotient is the IEEE one (``div_rn``, its code from a reciprocal and an FMA
correction: ``kernel._store_scaled``, or FMA corrections exact for every value a row can have:
``_quotient``, ``_token_head_scale``) and fp fusion is off at launch, so each value is the one
the oracle (``reference.quantize``, ``reference.quantize_token_head``) computes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Triton's own max combine where it has one (the interpreter reduces it with numpy).
_max_combine = getattr(tl.standard, "_elementwise_max", tl.maximum)


@triton.jit
def _round_fp8(v, E5M2: tl.constexpr):
    """Round fp32 to the float8_e4m3fn grid (float8_e5m2 with ``E5M2``), nearest even, in fp32
    arithmetic, for the interpreter, whose fp32->fp8 cast truncates: 3 (e5m2: 2) mantissa bits
    for normals; below the smallest normal, 2**-6 (2**-14), steps of 2**-9 (2**-16), rounded by
    adding and subtracting a constant whose ulp is that step (24576, 192; fp fusion is off).
    The sign is kept, also where a value rounds to zero (-0, as the GPU's conversion and torch's
    cast store it): the magnitude is rounded, then the sign put back ((v + c) - c would give +0
    for every negative v that rounds to zero)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    if E5M2:
        bits = (bits + 0xFFFFF + ((bits >> 21) & 1)) & 0xFFE00000
        magnitude = (tl.abs(v) + 192.0) - 192.0
        tiny = tl.abs(v) < 0.00006103515625
    else:
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        magnitude = (tl.abs(v) + 24576.0) - 24576.0
        tiny = tl.abs(v) < 0.015625
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tiny, subnormal, normal)


@triton.jit
def _store_fp8(out_ptr, off, v, mask, INTERPRETER: tl.constexpr, SAT_CVT: tl.constexpr):
    """Store fp32 ``v`` as the FP8 dtype of ``out_ptr``: saturated to +-448 (e4m3) or
    +-57344 (e5m2: no inf is stored, as vLLM's saturating conversion), nearest even, NaN stored
    as NaN (a clamp alone would turn an upstream NaN into in-range data). ``SAT_CVT``: the
    GPU converts with PTX ``cvt.rn.satfinite`` (sm_89 on), which does all of that itself (NaN
    as 0x7F); elsewhere the clamp and the NaN select are explicit."""
    FP8 = out_ptr.dtype.element_ty
    E5M2: tl.constexpr = FP8 == tl.float8e5
    if E5M2:
        clamped = tl.minimum(tl.maximum(v, -57344.0), 57344.0)
    else:
        clamped = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if SAT_CVT:  # (the clamp above is then dead code, dropped by the compiler)
        stored = v.to(FP8)
    elif INTERPRETER:
        # The interpreter's cast truncates and turns NaN into a number: round on the grid and
        # set NaN's bits (0x7F, either dtype's positive NaN) directly.
        bits = _round_fp8(clamped, E5M2).to(FP8).to(tl.uint8, bitcast=True)
        stored = tl.where(v != v, 0x7F, bits).to(tl.uint8).to(FP8, bitcast=True)
    else:  # a conversion that does not saturate (before sm_89: e5m2 in software)
        stored = tl.where(v != v, v, clamped).to(FP8)
    tl.store(out_ptr + off, stored, mask=mask)


@triton.jit
def _store_codes(out_ptr, off, y, mask, INTERPRETER: tl.constexpr, SAT_CVT: tl.constexpr):
    """Store fp32 ``y`` (a row already multiplied by its scale's reciprocal) as the codes of
    ``out_ptr``'s dtype: e4m3 (:func:`_store_fp8`), or int8 rounded half away from zero (vLLM's
    ``int8_per_token_head``; a NaN stored as 0: its row's scale is NaN). vLLM's clamp to
    [-128, 127] never acts on a per-token-head row (|y| < 127.00003, so ``y +- 0.5`` truncates
    into [-127, 127]; docs/design.md, "Per-token-head scales"): left out."""
    if out_ptr.dtype.element_ty == tl.int8:
        z = tl.where(y >= 0, y + 0.5, y - 0.5)
        if INTERPRETER:  # numpy's truncating cast turns NaN into a number: 0 selected first
            codes = tl.where(y != y, 0.0, z).to(tl.int32)
        else:  # PTX cvt.rzi gives NaN 0 (docs/design.md, "Per-token-head scales")
            codes = libdevice.float2int_rz(z)
        tl.store(out_ptr + off, codes.to(tl.int8), mask=mask)
    else:
        _store_fp8(out_ptr, off, y, mask, INTERPRETER, SAT_CVT)


@triton.jit
def _row_max(x):
    """max over a row (axis 2) of an fp32 tile -> [.., .., 1]."""
    return tl.reduce(x, 2, _max_combine)[:, :, None]


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _token_head_amax(x_lo, x_hi, out_ptr, ONE_ROW: tl.constexpr):
    """The amax over D of a written row from its fp32 halves (a V row passes itself twice),
    NaN not counted: the row maximum's own combine skips NaN (max.f32; an all-NaN row gives
    NaN, made 0 by one select per row). An int8 row holding a NaN gets amax NaN instead (a
    NaN-propagating maximum: no second reduction for a NaN flag). Separate from
    :func:`_token_head_scale` so the kernel runs K's and V's reductions before either division
    (docs/design.md, "Per-token-head scales").

    ``ONE_ROW`` (a tile of one row, one warp): the same value as the integer maximum of |x|'s
    bits, which orders every non-negative float as the float maximum does and puts NaN above
    inf, so it propagates NaN by itself (int8) or counts none once NaN's bits are made 0
    (FP8); across a whole warp Triton reduces it with one ``redux.sync`` instead of five
    shuffle rounds (docs/design.md, "Per-token-head scales": slower on wider tiles)."""
    if ONE_ROW:
        lo = x_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        hi = x_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        if out_ptr.dtype.element_ty != tl.int8:
            lo = tl.where(lo > 0x7F800000, 0, lo)
            hi = tl.where(hi > 0x7F800000, 0, hi)
        return tl.max(tl.maximum(lo, hi), 2)[:, :, None].to(tl.float32, bitcast=True)
    if out_ptr.dtype.element_ty == tl.int8:
        return tl.maximum(tl.reduce(tl.abs(x_lo), 2, _max_nan)[:, :, None],
                          tl.reduce(tl.abs(x_hi), 2, _max_nan)[:, :, None],
                          propagate_nan=tl.PropagateNan.ALL)
    amax = tl.maximum(_row_max(tl.abs(x_lo)), _row_max(tl.abs(x_hi)))
    return tl.where(amax != amax, 0.0, amax)


@triton.jit
def _quotient(a, Q: tl.constexpr, INTERPRETER: tl.constexpr):
    """``a / Q`` rounded to nearest, as ``div_rn`` gives it, from a product and one FMA
    correction: exact for every amax a row can have (a bf16 or fp16 value >= 0, or inf), and
    shorter on the decode program's amax -> scale -> codes chain (docs/design.md,
    "Per-token-head scales"). The interpreter has no fused FMA: it divides."""
    if INTERPRETER:
        q = tl.math.div_rn(a, Q)
    else:
        q0 = a * (1.0 / Q)
        q1 = tl.fma(tl.fma(-q0, Q, a), 1.0 / Q, q0)
        q = tl.where(q1 == q1, q1, q0)  # (inf: fma(-inf, Q, inf) is NaN)
    return q


@triton.jit
def _token_head_scale(amax, out_ptr, INTERPRETER: tl.constexpr):
    """A written row's scale and its reciprocal from :func:`_token_head_amax`:
    ``s = max(amax / Q, 1e-6)``, Q = 448 for e4m3, 127 for int8, as vLLM's per-token-head
    writer; an int8 row holding a NaN gets scale NaN (int8 has no NaN code: the row reads back
    as NaN, never as in-range data), and so does the reciprocal its codes are made with: every
    code of that row 0."""
    if out_ptr.dtype.element_ty == tl.int8:
        s = tl.maximum(_quotient(amax, 127.0, INTERPRETER), 1e-6)
        stored = tl.where(amax != amax, float("nan"), s)
    else:
        stored = tl.maximum(_quotient(amax, 448.0, INTERPRETER), 1e-6)
    if INTERPRETER:
        return stored, tl.math.div_rn(1.0, stored)
    # RN(1 / s) from Triton's `/` (div.full, within 2 ulp) and one Newton step: exact for every
    # scale a row can have, though not for every fp32 s (docs/design.md, "Per-token-head
    # scales"). An inf scale keeps r0 = 0 (r1 is NaN); NaN stays NaN.
    r0 = 1.0 / stored
    r1 = tl.fma(r0, tl.fma(-stored, r0, 1.0), r0)
    return stored, tl.where(r1 == r1, r1, r0)
