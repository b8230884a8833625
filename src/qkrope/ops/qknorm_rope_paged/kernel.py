"""Triton kernel: QK RMSNorm + RoPE + paged K/V cache write for token-major inputs, one launch.

A program owns ``BLOCK_H`` heads x ``BLOCK_T`` tokens. Programs with ``pid_h < cdiv(Hq,
BLOCK_H)`` handle query heads, the rest key/value heads plus the cache write of their rows at
``slot_mapping[t]`` (block ``slot // block_size``, offset ``slot % block_size``; the cache layout
lives entirely in the strides, so NHD, HND and per-sequence contiguous caches share this code).
Rows are handled as two halves of D/2, like the [B, H, S, D] kernel:

- full-rotary NeoX (the common case) is exactly that kernel's math and helpers;
- GPT-J pairs and partial rotary use one formula per element, ``out[d] = n[d]*cos[f(d)] +
  sign(d) * n[p(d)]*sin[f(d)]`` with the partner ``p(d)``, frequency ``f(d)`` and sign of the
  style; dims from ``ROT`` on pass through normalised, unrotated. Partner values are a second
  load of the same row (an L1 hit), which needs no register shuffles and runs in the
  interpreter.

Rounding points and interpreter rules as in ``qknorm_rope_cache/kernel.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..qknorm_rope_cache.kernel import (
    _cos_sin, _cos_sin_at, _load_halves, _load_weight_halves, _norm_rope, _round, _row_sum,
)


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
def _rotate_dims(x, x_ptr, row_off, stride_d, mask, d, w_ptr, stride_w, rstd, pos,
                 inv_freq_ptr, stride_inv_freq, ROT: tl.constexpr, GPTJ: tl.constexpr,
                 HF_NORM: tl.constexpr, W_OFFSET: tl.constexpr, INTERPRETER: tl.constexpr):
    """Normalise and rotate dims ``d`` [N] of rows ``x`` [BLOCK_H, BLOCK_T, N] (fp32)."""
    DT = x_ptr.dtype.element_ty
    partner, freq, sign, rotated = _pair_maps(d, ROT, GPTJ)
    xp = tl.load(x_ptr + row_off + partner[None, None, :] * stride_d, mask=mask, other=0.0)
    xp = xp.to(tl.float32)
    w = tl.load(w_ptr + d * stride_w).to(tl.float32)[None, None, :]
    wp = tl.load(w_ptr + partner * stride_w).to(tl.float32)[None, None, :]
    if HF_NORM:
        n = _round(w * _round(x * rstd, DT, INTERPRETER), DT, INTERPRETER)
        n_p = _round(wp * _round(xp * rstd, DT, INTERPRETER), DT, INTERPRETER)
    else:
        if W_OFFSET != 0.0:
            w = w + W_OFFSET
            wp = wp + W_OFFSET
        n = _round(w * (x * rstd), DT, INTERPRETER)
        n_p = _round(wp * (xp * rstd), DT, INTERPRETER)
    inv = tl.load(inv_freq_ptr + freq * stride_inv_freq).to(tl.float32)
    angle = pos.to(tl.float32)[None, :, None] * inv[None, None, :]
    cos, sin = _cos_sin(angle, DT, INTERPRETER, 0)
    out = _round(n * cos, DT, INTERPRETER) + sign[None, None, :] * _round(n_p * sin, DT,
                                                                          INTERPRETER)
    # Exact once rounded: the interpreter's truncating cast is safe.
    return tl.where(rotated[None, None, :], _round(out, DT, INTERPRETER), n).to(DT)


@triton.jit
def _norm_rotate(x_ptr, row_off, stride_d, mask, w_ptr, stride_w, pos, inv_freq_ptr,
                 stride_inv_freq, eps, D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr,
                 HF_NORM: tl.constexpr, W_OFFSET: tl.constexpr, INTERPRETER: tl.constexpr):
    """Normalised, rotated rows of a [BLOCK_H, BLOCK_T] tile as two DT halves [.., D/2].

    row_off: [BLOCK_H, BLOCK_T, 1] int64 element offsets of the rows; pos: [BLOCK_T] positions.
    """
    HALF: tl.constexpr = D // 2
    DT = x_ptr.dtype.element_ty
    d_lo = tl.arange(0, HALF)
    if not GPTJ and ROT == D:  # full NeoX rotary: the [B, H, S, D] kernel's own math
        w_lo, w_hi = _load_weight_halves(w_ptr, stride_w, HALF, W_OFFSET)
        x_lo, x_hi = _load_halves(x_ptr, row_off + d_lo[None, None, :] * stride_d,
                                  HALF * stride_d, mask, "")
        cos, sin = _cos_sin_at(pos, inv_freq_ptr, stride_inv_freq, DT, HALF, INTERPRETER, 0)
        lo, hi = _norm_rope(x_lo, x_hi, w_lo, w_hi, cos[None, :, :], sin[None, :, :], eps, DT,
                            HALF, INTERPRETER, HF_NORM)
    else:
        x_lo, x_hi = _load_halves(x_ptr, row_off + d_lo[None, None, :] * stride_d,
                                  HALF * stride_d, mask, "")
        # 1/D is a power of two for every supported head_dim: equals torch's sum * (1/D).
        rstd = tl.math.rsqrt((_row_sum(x_lo * x_lo) + _row_sum(x_hi * x_hi)) * (1.0 / D)
                             + eps)[:, :, None]
        lo = _rotate_dims(x_lo, x_ptr, row_off, stride_d, mask, d_lo, w_ptr, stride_w, rstd,
                          pos, inv_freq_ptr, stride_inv_freq, ROT, GPTJ, HF_NORM, W_OFFSET,
                          INTERPRETER)
        hi = _rotate_dims(x_hi, x_ptr, row_off, stride_d, mask, d_lo + HALF, w_ptr, stride_w,
                          rstd, pos, inv_freq_ptr, stride_inv_freq, ROT, GPTJ, HF_NORM,
                          W_OFFSET, INTERPRETER)
    return lo, hi


@triton.jit
def _round_e4m3(v):
    """Round fp32 to the float8_e4m3fn grid (nearest even) in fp32 arithmetic, for the
    interpreter, whose fp32->fp8 cast truncates: 3 mantissa bits for normals, steps of 2**-9
    below 2**-6 (the adds round at that step; fp fusion is off)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _store_cache(cache_ptr, off, vals, mask, scale_ptr, h, Hkv, SCALED: tl.constexpr,
                 PER_HEAD_SCALE: tl.constexpr, INTERPRETER: tl.constexpr):
    """Store rows into a cache; FP8 caches get saturate(x / scale) (vLLM's convention)."""
    if SCALED:
        if PER_HEAD_SCALE:  # heads past Hkv in the tile are masked: never read past the scales
            scale = tl.load(scale_ptr + h, mask=h < Hkv, other=1.0).to(tl.float32)
        else:
            scale = tl.load(scale_ptr).to(tl.float32)
        v = vals.to(tl.float32) / scale
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        if INTERPRETER:
            v = _round_e4m3(v)
        tl.store(cache_ptr + off, v.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(cache_ptr + off, vals, mask=mask)


@triton.jit
def qknorm_rope_paged_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_w_ptr, k_w_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr, k_scale_ptr, v_scale_ptr,
    eps, T, Hq, Hkv, block_size, num_slots,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_qo_t, stride_qo_h, stride_qo_d,
    stride_ko_t, stride_ko_h, stride_ko_d,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
    stride_pos, stride_slot, stride_q_w, stride_k_w, stride_inv_freq,
    D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr, HF_NORM: tl.constexpr,
    W_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, PER_HEAD_SCALE: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H)).

    Aliasing contract as in the [B, H, S, D] kernel: ``q_out`` may be ``q`` (``k_out`` ``k``).
    """
    HALF: tl.constexpr = D // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    eps = tl.cast(eps, tl.float32)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = t[None, :, None].to(tl.int64)
    n_q_blocks = (Hq + BLOCK_H - 1) // BLOCK_H  # not tl.cdiv: see _row_sum
    h_local = tl.arange(0, BLOCK_H)[:, None, None]
    d = tl.arange(0, HALF)[None, None, :]

    if pid_h < n_q_blocks:
        hq = pid_h * BLOCK_H + h_local
        q_mask = (hq < Hq) & (t3 < T)
        pos = tl.load(pos_ptr + t.to(tl.int64) * stride_pos, mask=t < T, other=0)
        q_lo, q_hi = _norm_rotate(q_ptr, t3 * stride_q_t + hq.to(tl.int64) * stride_q_h,
                                  stride_q_d, q_mask, q_w_ptr, stride_q_w, pos, inv_freq_ptr,
                                  stride_inv_freq, eps, D, ROT, GPTJ, HF_NORM, W_OFFSET,
                                  INTERPRETER)
        qo_off = t3 * stride_qo_t + hq.to(tl.int64) * stride_qo_h + d * stride_qo_d
        tl.store(q_out_ptr + qo_off, q_lo, mask=q_mask)
        tl.store(q_out_ptr + qo_off + HALF * stride_qo_d, q_hi, mask=q_mask)
    else:
        hk = (pid_h - n_q_blocks) * BLOCK_H + h_local
        k_mask = (hk < Hkv) & (t3 < T)
        v_off = t3 * stride_v_t + hk.to(tl.int64) * stride_v_h + d * stride_v_d
        v_lo = tl.load(v_ptr + v_off, mask=k_mask, other=0.0)
        v_hi = tl.load(v_ptr + v_off + HALF * stride_v_d, mask=k_mask, other=0.0)
        slot = tl.load(slot_ptr + t.to(tl.int64) * stride_slot, mask=t < T, other=-1)
        slot = slot.to(tl.int64)[None, :, None]
        pos = tl.load(pos_ptr + t.to(tl.int64) * stride_pos, mask=t < T, other=0)
        k_lo, k_hi = _norm_rotate(k_ptr, t3 * stride_k_t + hk.to(tl.int64) * stride_k_h,
                                  stride_k_d, k_mask, k_w_ptr, stride_k_w, pos, inv_freq_ptr,
                                  stride_inv_freq, eps, D, ROT, GPTJ, HF_NORM, W_OFFSET,
                                  INTERPRETER)
        ko_off = t3 * stride_ko_t + hk.to(tl.int64) * stride_ko_h + d * stride_ko_d
        tl.store(k_out_ptr + ko_off, k_lo, mask=k_mask)
        tl.store(k_out_ptr + ko_off + HALF * stride_ko_d, k_hi, mask=k_mask)

        # Slots outside [0, num_blocks * block_size) (e.g. -1 padding) are skipped.
        slot_mask = k_mask & (slot >= 0) & (slot < num_slots)
        blk = slot // block_size
        off = slot % block_size
        kc_off = (blk * stride_kc_blk + off * stride_kc_off + hk.to(tl.int64) * stride_kc_h
                  + d * stride_kc_d)
        vc_off = (blk * stride_vc_blk + off * stride_vc_off + hk.to(tl.int64) * stride_vc_h
                  + d * stride_vc_d)
        _store_cache(k_cache_ptr, kc_off, k_lo, slot_mask, k_scale_ptr, hk, Hkv, K_SCALED,
                     PER_HEAD_SCALE, INTERPRETER)
        _store_cache(k_cache_ptr, kc_off + HALF * stride_kc_d, k_hi, slot_mask, k_scale_ptr, hk,
                     Hkv, K_SCALED, PER_HEAD_SCALE, INTERPRETER)
        _store_cache(v_cache_ptr, vc_off, v_lo, slot_mask, v_scale_ptr, hk, Hkv, V_SCALED,
                     PER_HEAD_SCALE, INTERPRETER)
        _store_cache(v_cache_ptr, vc_off + HALF * stride_vc_d, v_hi, slot_mask, v_scale_ptr, hk,
                     Hkv, V_SCALED, PER_HEAD_SCALE, INTERPRETER)
