"""Triton kernel: QK RMSNorm + RoPE + paged K/V cache write for token-major inputs, one launch.

A program owns ``BLOCK_H`` heads x ``BLOCK_T`` tokens, each row whole (D up to 512). Programs
with ``pid_h < cdiv(Hq, BLOCK_H)`` handle query heads, the rest key/value heads plus the cache
write of their rows at ``slot_mapping[t]`` (block ``slot // block_size``, offset
``slot % block_size``; the cache layout lives entirely in the strides, so NHD, HND and
per-sequence contiguous caches share this code).

Every rotation style is one formula per element: ``out[d] = n[d]*cos[f(d)] + sign(d) *
n[p(d)]*sin[f(d)]`` with the partner ``p(d)``, frequency ``f(d)`` and sign of NeoX halves or
GPT-J pairs; dims from ``ROT`` on pass through normalised but unrotated. The partner values are
a second load of the same row (an L1 hit), which keeps the code free of register shuffles and
runnable in Triton's interpreter. Rounding points and interpreter rules as in
``qknorm_rope_cache/kernel.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..qknorm_rope_cache.kernel import _round, _row_sum


@triton.jit
def _pair_maps(D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr):
    """Per dim d of a row: partner dim, frequency index, sign of the sin term, rotated?"""
    d = tl.arange(0, D)
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
    return d, partner, freq, sign, rotated


@triton.jit
def _norm_rotate(x_ptr, row_off, stride_d, mask, w_ptr, stride_w, pos, inv_freq_ptr,
                 stride_inv_freq, eps, w_offset, D: tl.constexpr, ROT: tl.constexpr,
                 GPTJ: tl.constexpr, HF_NORM: tl.constexpr, INTERPRETER: tl.constexpr):
    """Normalise and rotate a [BLOCK_H, BLOCK_T, D] tile of rows; returns it in the row dtype.

    row_off: [BLOCK_H, BLOCK_T, 1] int64 element offsets of the rows; pos: [1, BLOCK_T, 1] fp32.
    """
    DT = x_ptr.dtype.element_ty
    d, partner, freq, sign, rotated = _pair_maps(D, ROT, GPTJ)
    x = tl.load(x_ptr + row_off + d[None, None, :] * stride_d, mask=mask, other=0.0)
    xp = tl.load(x_ptr + row_off + partner[None, None, :] * stride_d, mask=mask, other=0.0)
    w = tl.load(w_ptr + d * stride_w).to(tl.float32)
    wp = tl.load(w_ptr + partner * stride_w).to(tl.float32)
    inv = tl.load(inv_freq_ptr + freq * stride_inv_freq).to(tl.float32)
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)

    rstd = tl.math.rsqrt(_row_sum(x * x) * (1.0 / D) + eps)[:, :, None]
    if HF_NORM:
        n = _round(w[None, None, :] * _round(x * rstd, DT, INTERPRETER), DT, INTERPRETER)
        n_p = _round(wp[None, None, :] * _round(xp * rstd, DT, INTERPRETER), DT, INTERPRETER)
    else:
        n = _round((w + w_offset)[None, None, :] * (x * rstd), DT, INTERPRETER)
        n_p = _round((wp + w_offset)[None, None, :] * (xp * rstd), DT, INTERPRETER)

    angle = pos * inv[None, None, :]
    if INTERPRETER:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    else:  # full range reduction: angles reach 2**18 rad
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    cos = _round(cos, DT, INTERPRETER)
    sin = _round(sin, DT, INTERPRETER)
    out = _round(n * cos, DT, INTERPRETER) + sign[None, None, :] * _round(n_p * sin, DT,
                                                                          INTERPRETER)
    out = tl.where(rotated[None, None, :], _round(out, DT, INTERPRETER), n)
    # Exact once rounded: the interpreter's truncating cast is safe.
    return out.to(DT)


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
    eps, w_offset, T, Hq, Hkv, block_size, num_slots,
    stride_q_t, stride_q_h, stride_q_d,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_qo_t, stride_qo_h, stride_qo_d,
    stride_ko_t, stride_ko_h, stride_ko_d,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_kc_d,
    stride_vc_blk, stride_vc_off, stride_vc_h, stride_vc_d,
    stride_pos, stride_slot, stride_q_w, stride_k_w, stride_inv_freq,
    D: tl.constexpr, ROT: tl.constexpr, GPTJ: tl.constexpr, HF_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, K_SCALED: tl.constexpr,
    V_SCALED: tl.constexpr, PER_HEAD_SCALE: tl.constexpr, INTERPRETER: tl.constexpr,
):
    """Grid: (cdiv(T, BLOCK_T), cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H)).

    Aliasing contract as in the [B, H, S, D] kernel: ``q_out`` may be ``q`` (``k_out`` ``k``).
    """
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    eps = tl.cast(eps, tl.float32)
    w_offset = tl.cast(w_offset, tl.float32)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t3 = t[None, :, None].to(tl.int64)
    pos = tl.load(pos_ptr + t.to(tl.int64) * stride_pos, mask=t < T, other=0)
    pos3 = pos.to(tl.float32)[None, :, None]
    n_q_blocks = (Hq + BLOCK_H - 1) // BLOCK_H  # not tl.cdiv: see _row_sum
    h_local = tl.arange(0, BLOCK_H)[:, None, None]
    d = tl.arange(0, D)[None, None, :]

    if pid_h < n_q_blocks:
        hq = pid_h * BLOCK_H + h_local
        q_mask = (hq < Hq) & (t3 < T)
        q = _norm_rotate(q_ptr, t3 * stride_q_t + hq.to(tl.int64) * stride_q_h, stride_q_d,
                         q_mask, q_w_ptr, stride_q_w, pos3, inv_freq_ptr, stride_inv_freq, eps,
                         w_offset, D, ROT, GPTJ, HF_NORM, INTERPRETER)
        qo_off = t3 * stride_qo_t + hq.to(tl.int64) * stride_qo_h + d * stride_qo_d
        tl.store(q_out_ptr + qo_off, q, mask=q_mask)
    else:
        hk = (pid_h - n_q_blocks) * BLOCK_H + h_local
        k_mask = (hk < Hkv) & (t3 < T)
        v = tl.load(v_ptr + t3 * stride_v_t + hk.to(tl.int64) * stride_v_h + d * stride_v_d,
                    mask=k_mask, other=0.0)
        slot = tl.load(slot_ptr + t.to(tl.int64) * stride_slot, mask=t < T, other=-1)
        slot = slot.to(tl.int64)[None, :, None]
        k = _norm_rotate(k_ptr, t3 * stride_k_t + hk.to(tl.int64) * stride_k_h, stride_k_d,
                         k_mask, k_w_ptr, stride_k_w, pos3, inv_freq_ptr, stride_inv_freq, eps,
                         w_offset, D, ROT, GPTJ, HF_NORM, INTERPRETER)
        ko_off = t3 * stride_ko_t + hk.to(tl.int64) * stride_ko_h + d * stride_ko_d
        tl.store(k_out_ptr + ko_off, k, mask=k_mask)

        # Slots outside [0, num_blocks * block_size) (e.g. -1 padding) are skipped.
        slot_mask = k_mask & (slot >= 0) & (slot < num_slots)
        blk = slot // block_size
        off = slot % block_size
        kc_off = (blk * stride_kc_blk + off * stride_kc_off + hk.to(tl.int64) * stride_kc_h
                  + d * stride_kc_d)
        vc_off = (blk * stride_vc_blk + off * stride_vc_off + hk.to(tl.int64) * stride_vc_h
                  + d * stride_vc_d)
        _store_cache(k_cache_ptr, kc_off, k, slot_mask, k_scale_ptr, hk, Hkv, K_SCALED,
                     PER_HEAD_SCALE, INTERPRETER)
        _store_cache(v_cache_ptr, vc_off, v, slot_mask, v_scale_ptr, hk, Hkv, V_SCALED,
                     PER_HEAD_SCALE, INTERPRETER)
