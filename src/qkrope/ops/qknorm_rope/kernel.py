"""The Triton kernel of the op: per-head RMSNorm on Q and K, RoPE, and the K/V cache row write,
in one launch, for both entry points.

Work split: a program owns a tile of heads x ``BLOCK_T`` tokens of one batch element (grid axis
2; token-major inputs have one "batch" with batch strides 0). Programs with
``pid_h < cdiv(Hq, BLOCK_HQ)`` handle ``BLOCK_HQ`` query heads; the rest handle ``BLOCK_HKV``
key/value heads and also write the new K and V rows into the caches. Rows are processed as two
halves of ``D/2``, so NeoX's rotate-half pairs line up element by element and cos/sin are
computed once per program, shared by all heads of the tile.

Features are constexprs, compiled away when off:

- ``ROT < D`` (partial rotary) and ``GPTJ`` (interleaved pairs) use one formula per element,
  ``out[d] = n[d] cos[f(d)] + sign(d) n[p(d)] sin[f(d)]``, with the partner ``p(d)`` loaded a
  second time (an L1 hit: no register shuffles, and it runs in the interpreter);
- ``MROPE`` (1 contiguous sections, 2 interleaved) takes each frequency's position from one of
  three position streams (temporal, height, width), as Qwen2/3-VL and Qwen3.5 do;
- ``COS_SIN_SCALE`` multiplies fp32 cos/sin before their rounding (HF's ``attention_scaling``);
- ``W_OFFSET`` gives ``(offset + w)`` norm weights; ``HF_NORM`` HF's Qwen3RMSNorm rounding;
- ``PAGED`` addresses the cache by ``(row // block_size, row % block_size)``;
  ``K_SCALED``/``V_SCALED`` (FP8 caches) and ``QO_SCALED``/``KO_SCALED`` (FP8 query/key
  outputs) store ``saturate(x / scale)`` of the rotated rows; ``K_DYN``/``V_DYN`` quantise each
  written cache row with its own scale and store that scale too (vLLM's per-token-head).
- ``APPEND`` takes the cache rows from a running length that the launch advances (HF's
  StaticLayer: one launch instead of its bookkeeping kernels).

Interpreter (``TRITON_INTERPRET=1``) rules followed here: loads are upcast to fp32 at once and
all arithmetic is fp32; every store is masked; libdevice is only reached behind the
``INTERPRETER`` constexpr, which also swaps in exact roundings (the interpreter's fp32 -> bf16 and
-> fp8 casts truncate, while the GPU rounds to nearest even, as PyTorch does).

Addresses: ``WIDE`` (chosen by the launcher per call signature) computes every element offset
in int64, for calls where some tensor spans 2**31 elements or more (large caches, views with
huge strides); otherwise offsets are int32, whose shorter address arithmetic sits on every
program's path to its first load (docs/perf-notes.md, "int32 offsets"). Lanes that are masked
off may compute wrapped int32 offsets; they are never dereferenced.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .quantize import _store_codes, _store_fp8, _token_head_amax, _token_head_scale


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _index(x, WIDE: tl.constexpr):
    """``x`` as an element-offset integer: int64 with ``WIDE``, else int32."""
    if WIDE:
        return x.to(tl.int64)
    else:
        return x.to(tl.int32)


# Triton's own sum combine where it has one: the interpreter recognises it and sums with numpy,
# while any other combine runs per element in Python (~6 ms a row). Compiled, both are one add.
_sum_combine = getattr(tl.standard, "_sum_combine", _add)


@triton.jit
def _row_sum(x):
    """``tl.sum(x, axis=2)`` spelled with the reduce builtin: Triton's own @jit helpers
    (tl.sum, tl.cdiv) break in the interpreter when triton was imported before it was enabled
    (e.g. by transformers), while kernels defined here afterwards do not."""
    return tl.reduce(x, 2, _sum_combine)


@triton.jit
def _f32(x, INTERPRETER: tl.constexpr):
    """``x`` (loaded bf16, fp16 or fp32) as fp32. The interpreter's bf16 -> fp32 conversion
    gets subnormals wrong (docs/design.md, "Interpreter bf16 casts"): there, through the bits.
    There a signalling NaN is also made quiet: the interpreter's NaN-skipping max (numpy's)
    counts a signalling one, as a GPU's max.f32 does not (a per-token-head scale then differed
    from the oracle's)."""
    if INTERPRETER:
        if x.dtype == tl.bfloat16:
            y = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = x.to(tl.float32)
        return tl.where(y != y, float("nan"), y)
    else:
        return x.to(tl.float32)


@triton.jit
def _cast(x, DT: tl.constexpr, INTERPRETER: tl.constexpr):
    """fp32 ``x``, already on DT's grid (:func:`_round`), as DT: exact. The interpreter's
    fp32 -> bf16 conversion gets subnormals wrong: there, the high half of the bits."""
    if INTERPRETER and DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def _round(x, DT: tl.constexpr, INTERPRETER: tl.constexpr):
    """Round fp32 ``x`` to ``DT`` (nearest even) and return it as fp32: one rounding point."""
    if INTERPRETER and DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _mrope_stream(freq, MROPE: tl.constexpr, SEC_T: tl.constexpr, SEC_H: tl.constexpr,
                  SEC_W: tl.constexpr):
    """Which position stream (0 temporal, 1 height, 2 width) frequency ``freq`` rotates by."""
    if MROPE == 1:  # contiguous sections: [T x SEC_T | H x SEC_H | W x SEC_W]
        return tl.where(freq < SEC_T, 0, tl.where(freq < SEC_T + SEC_H, 1, 2))
    else:  # interleaved (Qwen3-VL, Qwen3.5): T H W T H W ..., T beyond the H/W sections
        h = ((freq % 3) == 1) & (freq < 3 * SEC_H)
        w = ((freq % 3) == 2) & (freq < 3 * SEC_W)
        return tl.where(h, 1, tl.where(w, 2, 0))


@triton.jit
def _angles(pos_ptr, pos_off, t_mask, freq, inv_freq_ptr, stride_inv_freq, stride_pos_r,
            MROPE: tl.constexpr, SEC_T: tl.constexpr, SEC_H: tl.constexpr, SEC_W: tl.constexpr,
            WIDE: tl.constexpr):
    """fp32 angles ``float32(position) * inv_freq[freq]`` -> [BLOCK_T, N] for tokens at
    position offsets ``pos_off`` [BLOCK_T] and frequency indices ``freq`` [N]."""
    # (bf16 / fp16 inv_freq: exact in fp32, as the model's own .float())
    inv = tl.load(inv_freq_ptr + _index(freq, WIDE) * stride_inv_freq).to(tl.float32)
    if MROPE == 0:
        pos = tl.load(pos_ptr + pos_off, mask=t_mask, other=0)
        return pos.to(tl.float32)[:, None] * inv[None, :]
    else:
        stream = _index(_mrope_stream(freq, MROPE, SEC_T, SEC_H, SEC_W), WIDE)
        pos = tl.load(pos_ptr + pos_off[:, None] + stream[None, :] * stride_pos_r,
                      mask=t_mask[:, None], other=0)
        return pos.to(tl.float32) * inv[None, :]


@triton.jit
def _cos_sin(angle, DT: tl.constexpr, COS_SIN_SCALE: tl.constexpr, INTERPRETER: tl.constexpr):
    """cos/sin of fp32 angles, scaled in fp32, as fp32 holding values rounded to ``DT``."""
    if INTERPRETER:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    else:
        # Angles reach 2**18 rad: the hardware sin/cos approximations are wrong there, the
        # libdevice versions do full range reduction (the same code torch's CUDA cos runs).
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    if COS_SIN_SCALE != 1.0:
        cos = cos * COS_SIN_SCALE
        sin = sin * COS_SIN_SCALE
    return _round(cos, DT, INTERPRETER), _round(sin, DT, INTERPRETER)


@triton.jit
def _load_halves(x_ptr, off_lo, off_hi, mask, INTERPRETER: tl.constexpr):
    """Both halves of a tile of rows at element offsets, upcast to fp32."""
    x1 = tl.load(x_ptr + off_lo, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + off_hi, mask=mask, other=0.0)
    return _f32(x1, INTERPRETER), _f32(x2, INTERPRETER)


@triton.jit
def _load_weight(w_ptr, d, stride_w, W_OFFSET: tl.constexpr, INTERPRETER: tl.constexpr,
                 WIDE: tl.constexpr):
    """Norm weight at dims ``d`` [N] as fp32 [1, 1, N] (``W_OFFSET + w``: Gemma/Qwen3.5 style).

    Callers load the weights with the rows, before any sin/cos work: loaded inside the math
    they would sit behind its layout-conversion barriers, a serial memory round trip or two per
    program."""
    # Indexed in the rows' 3-D shape: a 1-D load expanded afterwards would need a layout
    # conversion through shared memory (a barrier behind the load) before the rows load.
    w = _f32(tl.load(w_ptr + _index(d, WIDE)[None, None, :] * stride_w), INTERPRETER)
    if W_OFFSET != 0.0:
        w = w + W_OFFSET
    return w


@triton.jit
def _rstd(x1, x2, eps, D: tl.constexpr):
    # 1/D is a power of two for every supported head_dim, so this equals torch's sum * (1/D).
    return tl.math.rsqrt((_row_sum(x1 * x1) + _row_sum(x2 * x2)) * (1.0 / D) + eps)[:, :, None]


@triton.jit
def _normed(x, w, rstd, DT: tl.constexpr, HF_NORM: tl.constexpr, INTERPRETER: tl.constexpr):
    """The normalized row in DT (as fp32): one rounding after the fp32 weight multiply, or with
    ``HF_NORM`` (HF's Qwen3RMSNorm) a rounding before and one after a weight multiply in DT."""
    if HF_NORM:
        return _round(w * _round(x * rstd, DT, INTERPRETER), DT, INTERPRETER)
    else:
        return _round(w * (x * rstd), DT, INTERPRETER)


@triton.jit
def _neox(n1, n2, cos, sin, DT: tl.constexpr, INTERPRETER: tl.constexpr):
    """Full NeoX rotation of normalized halves; every product and sum rounded to DT."""
    # Each product of two DT values is exact in fp32, so round(fp32 product) is the DT product;
    # LLVM emits these as native bf16/fp16 multiplies. fp fusion is off at launch: an FMA
    # would skip the rounding of a product.
    o1 = _round(n1 * cos, DT, INTERPRETER) - _round(n2 * sin, DT, INTERPRETER)
    o2 = _round(n2 * cos, DT, INTERPRETER) + _round(n1 * sin, DT, INTERPRETER)
    return (_cast(_round(o1, DT, INTERPRETER), DT, INTERPRETER),
            _cast(_round(o2, DT, INTERPRETER), DT, INTERPRETER))


@triton.jit
def _pair_maps(d, ROT: tl.constexpr, GPTJ: tl.constexpr):
    """For dims d: partner dim, frequency index, sign of the sin term, rotated?"""
    if GPTJ:
        first = (d % 2) == 0
        partner = tl.where(first, d + 1, d - 1)
        freq = d // 2
    else:
        first = d < ROT // 2
        partner = tl.where(first, d + ROT // 2, d - ROT // 2)
        freq = tl.where(first, d, d - ROT // 2)
    rotated = d < ROT
    partner = tl.where(rotated, partner, d)
    freq = tl.where(rotated, freq, 0)
    sign = tl.where(first, -1.0, 1.0)
    return partner, freq, sign, rotated


@triton.jit
def _rotate_dims(x, x_ptr, row_off, stride_d, mask, d, w, w_ptr, stride_w, rstd, pos_ptr,
                 pos_off, t_mask, inv_freq_ptr, stride_inv_freq, stride_pos_r,
                 ROT: tl.constexpr, GPTJ: tl.constexpr, HF_NORM: tl.constexpr,
                 W_OFFSET: tl.constexpr, COS_SIN_SCALE: tl.constexpr, MROPE: tl.constexpr,
                 SEC_T: tl.constexpr, SEC_H: tl.constexpr, SEC_W: tl.constexpr,
                 INTERPRETER: tl.constexpr, WIDE: tl.constexpr):
    """Normalise and rotate dims ``d`` [N] of fp32 rows ``x`` [BLOCK_H, BLOCK_T, N] (partial
    rotary / GPT-J); dims from ``ROT`` on pass through normalised, unrotated."""
    DT = x_ptr.dtype.element_ty
    partner, freq, sign, rotated = _pair_maps(d, ROT, GPTJ)
    xp = _f32(tl.load(x_ptr + row_off + _index(partner, WIDE)[None, None, :] * stride_d,
                      mask=mask, other=0.0), INTERPRETER)
    wp = _load_weight(w_ptr, partner, stride_w, W_OFFSET, INTERPRETER, WIDE)
    n = _normed(x, w, rstd, DT, HF_NORM, INTERPRETER)
    n_p = _normed(xp, wp, rstd, DT, HF_NORM, INTERPRETER)
    R2: tl.constexpr = ROT // 2
    BT: tl.constexpr = x.shape[1]
    N: tl.constexpr = x.shape[2]
    # NeoX's frequency of dim d is d mod ROT/2: where the dims are a whole number of periods
    # (the low half of a partial rotary, Qwen3.5's 64 of 256), the trig runs on the ROT/2
    # distinct frequencies and is tiled over the dims (docs/design.md, "Partial rotary").
    PERIODIC: tl.constexpr = (not GPTJ) and ROT <= N and N % R2 == 0 and (R2 & (R2 - 1)) == 0
    if PERIODIC:
        angle = _angles(pos_ptr, pos_off, t_mask, tl.arange(0, R2), inv_freq_ptr,
                        stride_inv_freq, stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, WIDE)
        cos, sin = _cos_sin(angle, DT, COS_SIN_SCALE, INTERPRETER)
        cos = tl.reshape(tl.broadcast_to(cos[:, None, :], (BT, N // R2, R2)), (BT, N))[None]
        sin = tl.reshape(tl.broadcast_to(sin[:, None, :], (BT, N // R2, R2)), (BT, N))[None]
    else:
        angle = _angles(pos_ptr, pos_off, t_mask, freq, inv_freq_ptr, stride_inv_freq,
                        stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, WIDE)
        cos, sin = _cos_sin(angle[None, :, :], DT, COS_SIN_SCALE, INTERPRETER)
    out = (_round(n * cos, DT, INTERPRETER)
           + sign[None, None, :] * _round(n_p * sin, DT, INTERPRETER))
    return _cast(tl.where(rotated[None, None, :], _round(out, DT, INTERPRETER), n), DT,
                 INTERPRETER)


@triton.jit
def _load_tile(x_ptr, row_off, stride_d, mask, w_ptr, stride_w, D: tl.constexpr,
               W_OFFSET: tl.constexpr, INTERPRETER: tl.constexpr, WIDE: tl.constexpr):
    """Norm weights and rows of a [BLOCK_H, BLOCK_T] tile as fp32 halves [.., D/2].

    row_off: [BLOCK_H, BLOCK_T, 1] element offsets of the rows. Callers issue every load
    of a program (this, V, slots) before any math, so they share one DRAM round trip (decode is
    latency-bound)."""
    HALF: tl.constexpr = D // 2
    d_lo = tl.arange(0, HALF)
    d_hi = d_lo + HALF
    w_lo = _load_weight(w_ptr, d_lo, stride_w, W_OFFSET, INTERPRETER, WIDE)
    w_hi = _load_weight(w_ptr, d_hi, stride_w, W_OFFSET, INTERPRETER, WIDE)
    x_lo, x_hi = _load_halves(x_ptr, row_off + _index(d_lo, WIDE)[None, None, :] * stride_d,
                              row_off + _index(d_hi, WIDE)[None, None, :] * stride_d, mask,
                              INTERPRETER)
    return w_lo, w_hi, x_lo, x_hi


@triton.jit
def _norm_rope_tile(x_lo, x_hi, w_lo, w_hi, x_ptr, row_off, stride_d, mask, w_ptr, stride_w,
                    pos_ptr, pos_off, t_mask, inv_freq_ptr, stride_inv_freq, stride_pos_r, eps,
                    D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr,
                    HF_NORM: tl.constexpr, W_OFFSET: tl.constexpr,
                    COS_SIN_SCALE: tl.constexpr, MROPE: tl.constexpr, SEC_T: tl.constexpr,
                    SEC_H: tl.constexpr, SEC_W: tl.constexpr, INTERPRETER: tl.constexpr,
                    WIDE: tl.constexpr):
    """Normalised, rotated halves (DT) of a tile loaded by :func:`_load_tile`; pos_off:
    [BLOCK_T] offsets of the tokens' positions."""
    HALF: tl.constexpr = D // 2
    DT = x_ptr.dtype.element_ty
    d_lo = tl.arange(0, HALF)
    d_hi = d_lo + HALF
    if not GPTJ and ROT == D:  # full NeoX rotary: one cos/sin per frequency, shared by halves
        # Program order steers the SASS schedule (docs/perf-notes.md, "one op core"). Tiles of
        # several rows: the reduction first, so its rsqrt overlaps the trig instead of waiting
        # behind the trig's layout conversions. One-row (decode) tiles have no conversions:
        # there the trig first, its polynomial chain overlapping the row sum (measured faster).
        one_row: tl.constexpr = x_lo.shape[0] * x_lo.shape[1] == 1
        if not one_row:
            rstd = _rstd(x_lo, x_hi, eps, D)
        angle = _angles(pos_ptr, pos_off, t_mask, d_lo, inv_freq_ptr, stride_inv_freq,
                        stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, WIDE)
        cos, sin = _cos_sin(angle, DT, COS_SIN_SCALE, INTERPRETER)
        if one_row:
            rstd = _rstd(x_lo, x_hi, eps, D)
        lo, hi = _neox(_normed(x_lo, w_lo, rstd, DT, HF_NORM, INTERPRETER),
                       _normed(x_hi, w_hi, rstd, DT, HF_NORM, INTERPRETER),
                       cos[None, :, :], sin[None, :, :], DT, INTERPRETER)
    else:
        rstd = _rstd(x_lo, x_hi, eps, D)
        lo = _rotate_dims(x_lo, x_ptr, row_off, stride_d, mask, d_lo, w_lo, w_ptr, stride_w,
                          rstd, pos_ptr, pos_off, t_mask, inv_freq_ptr, stride_inv_freq,
                          stride_pos_r, ROT, GPTJ, HF_NORM, W_OFFSET, COS_SIN_SCALE, MROPE,
                          SEC_T, SEC_H, SEC_W, INTERPRETER, WIDE)
        if not GPTJ and ROT <= HALF:
            # NeoX pairs of a partial rotary (Qwen3.5: 64 of 256 dims) all lie in the low
            # half: the high half is only normalised (no partner loads, no trig).
            hi = _cast(_normed(x_hi, w_hi, rstd, DT, HF_NORM, INTERPRETER), DT, INTERPRETER)
        else:
            hi = _rotate_dims(x_hi, x_ptr, row_off, stride_d, mask, d_hi, w_hi, w_ptr,
                              stride_w, rstd, pos_ptr, pos_off, t_mask, inv_freq_ptr,
                              stride_inv_freq, stride_pos_r, ROT, GPTJ, HF_NORM, W_OFFSET,
                              COS_SIN_SCALE, MROPE, SEC_T, SEC_H, SEC_W, INTERPRETER, WIDE)
    return lo, hi


@triton.jit
def _static_scale(scale_ptr, h, H, stride_scale, SCALED: tl.constexpr, WIDE: tl.constexpr):
    """The given FP8 scale of each head of the tile (per-tensor scales come with stride 0;
    heads past H are masked), loaded with the tile: a load issued after the norm's reduction
    would add a memory latency to every program (docs/design.md, "FP8 stores")."""
    if SCALED:
        return tl.load(scale_ptr + _index(h, WIDE) * stride_scale, mask=h < H,
                       other=1.0).to(tl.float32)
    else:
        return 1.0


@triton.jit
def _store_scaled(out_ptr, off, vals, mask, scale, SCALED: tl.constexpr,
                  INTERPRETER: tl.constexpr, SAT_CVT: tl.constexpr):
    """Store rows (a cache's, or a quantised output's); FP8 gets saturate(x / scale) (vLLM's
    convention) with the tile's :func:`_static_scale`."""
    if SCALED:
        # The IEEE quotient's FP8 code, as torch's x / scale (Triton's fp32 `/` is div.full, up
        # to 2 ulp off, which can tip a rounding): the head's reciprocal, then per element one
        # FMA correction instead of a div_rn each, in a form with no select and no negation per
        # element (docs/design.md, "FP8 stores"). The interpreter has no fused FMA.
        x = _f32(vals, INTERPRETER)
        if INTERPRETER:
            q = tl.math.div_rn(x, scale)
        else:
            # Per head: m = 2**64 for a subnormal scale (its reciprocal overflows: x * 2**64 /
            # |s| * 2**64, both exact; an x that overflows saturates either way); the scale's
            # sign goes to x (a negative or -0 scale is no more valid, but the oracle's bytes
            # hold for every scale value), negated with the reciprocal, because Triton's unary
            # minus is `0 - v` (an FADD, and +0 for +0): nx * nr = x' * r exactly, and -0 keeps
            # its sign through the residual.
            a = tl.abs(scale)
            m = tl.where((a > 0.0) & (a < 1.1754943508222875e-38), 18446744073709551616.0, 1.0)
            nm = tl.where(scale.to(tl.int32, bitcast=True) < 0, m, -m)
            s = a * m
            nr = tl.math.div_rn(-1.0, s)
            nx = x * nm
            # q0 clamped past every FP8 maximum (NaN kept: one min.NaN.xorsign.abs), so an
            # infinite x or quotient leaves a finite residual; an infinite scale's residual is
            # taken against 0.
            q0 = tl.clamp(nx * nr, -131072.0, 131072.0, propagate_nan=tl.PropagateNan.ALL)
            q = tl.fma(tl.fma(q0, tl.where(s == float("inf"), 0.0, s), nx), nr, q0)
        _store_fp8(out_ptr, off, q, mask, INTERPRETER, SAT_CVT)
    else:
        tl.store(out_ptr + off, vals, mask=mask)


@triton.jit
def _cache_row(row, b, h, block_size, stride_b, stride_blk, stride_row, stride_h,
               PAGED: tl.constexpr):
    """Element offset of cache row ``row`` of batch element ``b`` and head ``h``: a K or V
    cache's row (then plus the dim's offset), or that row's scale in a scale cache. Paged:
    block ``row // block_size``, offset ``row % block_size``."""
    if PAGED:
        off = (row // block_size) * stride_blk + (row % block_size) * stride_row
    else:
        off = row * stride_row
    return off + b * stride_b + h * stride_h


@triton.jit
def qknorm_rope_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_w_ptr, k_w_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr, k_scale_ptr, v_scale_ptr, q_scale_ptr,
    k_scale_cache_ptr, v_scale_cache_ptr,
    eps, T, Hq, Hkv, rows_per_batch, block_size,
    stride_q_b, stride_q_h, stride_q_t, stride_q_d,
    stride_k_b, stride_k_h, stride_k_t, stride_k_d,
    stride_v_b, stride_v_h, stride_v_t, stride_v_d,
    stride_qo_b, stride_qo_h, stride_qo_t, stride_qo_d,
    stride_ko_b, stride_ko_h, stride_ko_t, stride_ko_d,
    stride_kc_b, stride_kc_blk, stride_kc_row, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_blk, stride_vc_row, stride_vc_h, stride_vc_d,
    stride_pos_r, stride_pos_b, stride_pos_t, stride_slot,
    stride_q_w, stride_k_w, stride_inv_freq, stride_k_scale, stride_v_scale, stride_q_scale,
    stride_ksc_b, stride_ksc_blk, stride_ksc_row, stride_ksc_h,
    stride_vsc_b, stride_vsc_blk, stride_vsc_row, stride_vsc_h,
    D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr, HF_NORM: tl.constexpr,
    W_OFFSET: tl.constexpr, COS_SIN_SCALE: tl.constexpr, MROPE: tl.constexpr,
    SEC_T: tl.constexpr, SEC_H: tl.constexpr, SEC_W: tl.constexpr, PAGED: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, QO_SCALED: tl.constexpr,
    KO_SCALED: tl.constexpr, K_DYN: tl.constexpr, V_DYN: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_T: tl.constexpr,
    APPEND: tl.constexpr, INTERPRETER: tl.constexpr, SAT_CVT: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(Hq, BLOCK_HQ) + cdiv(Hkv, BLOCK_HKV), B).

    Token t of batch element b goes to cache row ``slot[t]`` of that element's cache; rows
    outside ``[0, rows_per_batch)`` (e.g. -1 padding) are skipped, checked *before* the batch's
    base is added, so row -1 of batch b never lands in batch b - 1. ``APPEND``: ``slot`` is
    one int64, the cache's running length n; token t goes to row n + t, and the launch leaves
    n + T there (docs/design.md, "Appending at a running length").

    Aliasing contract: every element a program stores was loaded by that same program first,
    so ``q_out`` may be ``q`` itself (and ``k_out`` ``k``); nothing else may overlap.
    """
    HALF: tl.constexpr = D // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = _index(tl.program_id(2), WIDE)
    eps = tl.cast(eps, tl.float32)

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    t_i = _index(t, WIDE)
    t3 = t_i[None, :, None]
    pos_off = b * stride_pos_b + t_i * stride_pos_t
    n_q_blocks = (Hq + BLOCK_HQ - 1) // BLOCK_HQ  # not tl.cdiv: see _row_sum
    d_lo = _index(tl.arange(0, HALF), WIDE)[None, None, :]
    d_hi = d_lo + HALF

    # Triton needs a value assigned in both branches to have one type, so names differ by branch.
    if pid_h < n_q_blocks:
        hq = (pid_h * BLOCK_HQ + tl.arange(0, BLOCK_HQ))[:, None, None]
        q_mask = (hq < Hq) & (t3 < T)
        hq_i = _index(hq, WIDE)
        q_row = b * stride_q_b + hq_i * stride_q_h + t3 * stride_q_t
        qw_lo, qw_hi, qx_lo, qx_hi = _load_tile(q_ptr, q_row, stride_q_d, q_mask, q_w_ptr,
                                                stride_q_w, D, W_OFFSET, INTERPRETER, WIDE)
        q_sc = _static_scale(q_scale_ptr, hq, Hq, stride_q_scale, QO_SCALED, WIDE)
        q_lo, q_hi = _norm_rope_tile(
            qx_lo, qx_hi, qw_lo, qw_hi, q_ptr, q_row, stride_q_d, q_mask, q_w_ptr, stride_q_w,
            pos_ptr, pos_off, t_mask, inv_freq_ptr, stride_inv_freq, stride_pos_r, eps, D, ROT,
            GPTJ, HF_NORM, W_OFFSET, COS_SIN_SCALE, MROPE, SEC_T, SEC_H, SEC_W, INTERPRETER,
            WIDE)
        qo_row = b * stride_qo_b + hq_i * stride_qo_h + t3 * stride_qo_t
        _store_scaled(q_out_ptr, qo_row + d_lo * stride_qo_d, q_lo, q_mask, q_sc, QO_SCALED,
                      INTERPRETER, SAT_CVT)
        _store_scaled(q_out_ptr, qo_row + d_hi * stride_qo_d, q_hi, q_mask, q_sc, QO_SCALED,
                      INTERPRETER, SAT_CVT)
    else:
        hk = ((pid_h - n_q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV))[:, None, None]
        k_mask = (hk < Hkv) & (t3 < T)
        hk_i = _index(hk, WIDE)
        k_row = b * stride_k_b + hk_i * stride_k_h + t3 * stride_k_t
        kw_lo, kw_hi, kx_lo, kx_hi = _load_tile(k_ptr, k_row, stride_k_d, k_mask, k_w_ptr,
                                                stride_k_w, D, W_OFFSET, INTERPRETER, WIDE)
        d_full = _index(tl.arange(0, D), WIDE)[None, None, :]
        v = tl.load(v_ptr + b * stride_v_b + hk_i * stride_v_h + t3 * stride_v_t
                    + d_full * stride_v_d, mask=k_mask, other=0.0)
        if APPEND:
            # One atomic per K/V program takes the running length n (low 32 bits) and a ticket
            # (high bits); the program holding the last ticket runs after every other one took
            # n, so it alone stores n + T, clearing the tickets. Any other value on entry (a
            # negative n, stale tickets, rows past the cache) fails the assert: a device-side
            # assert, as the stock StaticLayer's index_copy_ raises there. (A scalar atomic is
            # one per program, its result broadcast to the program's threads; tests/
            # test_append.py checks the length advances by exactly T.)
            taken = tl.atomic_add(slot_ptr, 1 << 32, sem="relaxed")
            n = taken & 0xFFFFFFFF
            ticket = taken >> 32
            n_kv = (tl.num_programs(0).to(tl.int64) * (tl.num_programs(1) - n_q_blocks)
                    * tl.num_programs(2))
            tl.device_assert((ticket >= 0) & (ticket < n_kv) & (n + T <= rows_per_batch),
                             "qkrope: cache_position (append=True, the cache's running length) "
                             "is negative or leaves no room for the S new rows: the cache is "
                             "full")
            if ticket == n_kv - 1:
                tl.store(slot_ptr, n + T)
            row = tl.where(t_mask, n + t, -1)
        else:
            # In the index tensor's own type: the range check must see the row before any
            # narrowing to the offset width (an int64 row of 2**32 + 5 is not row 5).
            row = tl.load(slot_ptr + t_i * stride_slot, mask=t_mask, other=-1)
        ko_sc = _static_scale(k_scale_ptr, hk, Hkv, stride_k_scale, KO_SCALED, WIDE)
        kc_sc = _static_scale(k_scale_ptr, hk, Hkv, stride_k_scale, K_SCALED, WIDE)
        vc_sc = _static_scale(v_scale_ptr, hk, Hkv, stride_v_scale, V_SCALED, WIDE)
        k_lo, k_hi = _norm_rope_tile(
            kx_lo, kx_hi, kw_lo, kw_hi, k_ptr, k_row, stride_k_d, k_mask, k_w_ptr, stride_k_w,
            pos_ptr, pos_off, t_mask, inv_freq_ptr, stride_inv_freq, stride_pos_r, eps, D, ROT,
            GPTJ, HF_NORM, W_OFFSET, COS_SIN_SCALE, MROPE, SEC_T, SEC_H, SEC_W, INTERPRETER,
            WIDE)
        ko_row = b * stride_ko_b + hk_i * stride_ko_h + t3 * stride_ko_t
        _store_scaled(k_out_ptr, ko_row + d_lo * stride_ko_d, k_lo, k_mask, ko_sc, KO_SCALED,
                      INTERPRETER, SAT_CVT)
        _store_scaled(k_out_ptr, ko_row + d_hi * stride_ko_d, k_hi, k_mask, ko_sc, KO_SCALED,
                      INTERPRETER, SAT_CVT)

        row3 = row[None, :, None]
        row_mask = k_mask & (row3 >= 0) & (row3 < rows_per_batch)
        row3 = _index(row3, WIDE)
        kc_row = _cache_row(row3, b, hk_i, block_size, stride_kc_b, stride_kc_blk,
                            stride_kc_row, stride_kc_h, PAGED)
        vc_row = _cache_row(row3, b, hk_i, block_size, stride_vc_b, stride_vc_blk,
                            stride_vc_row, stride_vc_h, PAGED)
        # Each row's own scale, stored too (docs/design.md, "Per-token-head scales"): both
        # rows' reductions first, so their shuffles interleave before the first division.
        ONE_ROW: tl.constexpr = BLOCK_HKV * BLOCK_T == 1
        if K_DYN:
            k32_lo, k32_hi = _f32(k_lo, INTERPRETER), _f32(k_hi, INTERPRETER)
            k_amax = _token_head_amax(k32_lo, k32_hi, k_cache_ptr, ONE_ROW)
        if V_DYN:
            v32 = _f32(v, INTERPRETER)
            v_amax = _token_head_amax(v32, v32, v_cache_ptr, ONE_ROW)
        if K_DYN:
            k_sc, k_r = _token_head_scale(k_amax, k_cache_ptr, INTERPRETER)
            _store_codes(k_cache_ptr, kc_row + d_lo * stride_kc_d, k32_lo * k_r, row_mask,
                         INTERPRETER, SAT_CVT)
            _store_codes(k_cache_ptr, kc_row + d_hi * stride_kc_d, k32_hi * k_r, row_mask,
                         INTERPRETER, SAT_CVT)
            tl.store(k_scale_cache_ptr + _cache_row(row3, b, hk_i, block_size, stride_ksc_b,
                                                    stride_ksc_blk, stride_ksc_row,
                                                    stride_ksc_h, PAGED), k_sc, mask=row_mask)
        else:
            _store_scaled(k_cache_ptr, kc_row + d_lo * stride_kc_d, k_lo, row_mask, kc_sc,
                          K_SCALED, INTERPRETER, SAT_CVT)
            _store_scaled(k_cache_ptr, kc_row + d_hi * stride_kc_d, k_hi, row_mask, kc_sc,
                          K_SCALED, INTERPRETER, SAT_CVT)
        if V_DYN:
            v_sc, v_r = _token_head_scale(v_amax, v_cache_ptr, INTERPRETER)
            _store_codes(v_cache_ptr, vc_row + d_full * stride_vc_d, v32 * v_r, row_mask,
                         INTERPRETER, SAT_CVT)
            tl.store(v_scale_cache_ptr + _cache_row(row3, b, hk_i, block_size, stride_vsc_b,
                                                    stride_vsc_blk, stride_vsc_row,
                                                    stride_vsc_h, PAGED), v_sc, mask=row_mask)
        else:
            _store_scaled(v_cache_ptr, vc_row + d_full * stride_vc_d, v, row_mask, vc_sc,
                          V_SCALED, INTERPRETER, SAT_CVT)


@triton.jit
def rope_cos_sin_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
    T, S, stride_pos_r, stride_pos_b, stride_pos_s, stride_inv_freq,
    HALF: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_T: tl.constexpr,
    COS_SIN_SCALE: tl.constexpr, MROPE: tl.constexpr, SEC_T: tl.constexpr,
    SEC_H: tl.constexpr, SEC_W: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """The rotary table HF's rotary embeddings return: ``cos``/``sin`` [B, S, 2 HALF]
    (contiguous, of ``cos_ptr``'s dtype), both halves of a row the same ``HALF`` values, each
    the op's own cos/sin of ``float32(position) * inv_freq`` (a table and the op agree bit for
    bit).
    Grid: (cdiv(T, BLOCK_T),) over the T = B * S tokens. Offsets are int64: a table spans
    T * 2 HALF elements, past 2**31 for long batched prefills."""
    DT = cos_ptr.dtype.element_ty
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = t < T
    pos_off = (t // S) * stride_pos_b + (t % S) * stride_pos_s
    f = tl.arange(0, BLOCK_F)
    f_mask = f < HALF
    # Padding lanes (HALF not a power of two) read the last frequency, never past the tensor.
    freq = tl.minimum(f, HALF - 1)
    angle = _angles(pos_ptr, pos_off, t_mask, freq, inv_freq_ptr, stride_inv_freq,
                    stride_pos_r, MROPE, SEC_T, SEC_H, SEC_W, True)
    cos, sin = _cos_sin(angle, DT, COS_SIN_SCALE, INTERPRETER)
    cos, sin = _cast(cos, DT, INTERPRETER), _cast(sin, DT, INTERPRETER)
    off = t[:, None] * (2 * HALF) + f[None, :]
    mask = t_mask[:, None] & f_mask[None, :]
    tl.store(cos_ptr + off, cos, mask=mask)
    tl.store(cos_ptr + off + HALF, cos, mask=mask)
    tl.store(sin_ptr + off, sin, mask=mask)
    tl.store(sin_ptr + off + HALF, sin, mask=mask)
