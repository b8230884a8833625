"""Triton kernel: per-head RMSNorm on Q and K, NeoX RoPE, and the K/V cache row write, one launch.

Work split: a program owns a tile of heads x ``BLOCK_S`` tokens of one batch element. Programs
with ``pid_h < cdiv(Hq, BLOCK_HQ)`` handle ``BLOCK_HQ`` query heads; the rest handle
``BLOCK_HKV`` key/value heads and also write the new K and V rows into the caches. cos/sin are
computed once per program for its ``BLOCK_S`` tokens and shared by all heads of the tile. Rows
are processed as two halves of ``D/2`` so the rotate-half pairs line up element by element.

Interpreter (``TRITON_INTERPRET=1``) rules followed here: loads are upcast to fp32 at once and all
arithmetic is fp32; every store is masked; libdevice is only reached behind the ``INTERPRETER``
constexpr, which also swaps in an exact bf16 rounding (the interpreter's fp32->bf16 cast
truncates, while the GPU's rounds to nearest even, as PyTorch does).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _offsets(b, h, s, d, stride_b, stride_h, stride_s, stride_d):
    """int64 element offsets of ``[b, h, s, d]`` through real strides (caches exceed 2**31)."""
    return (
        b.to(tl.int64) * stride_b
        + h.to(tl.int64) * stride_h
        + s.to(tl.int64) * stride_s
        + d.to(tl.int64) * stride_d
    )


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_sum(x):
    """``tl.sum(x, axis=2)`` spelled with the reduce builtin: Triton's own @jit helpers
    (tl.sum, tl.cdiv) break in the interpreter when triton was imported before it was enabled
    (e.g. by transformers), while kernels defined here afterwards do not."""
    return tl.reduce(x, 2, _add)


@triton.jit
def _round(x, DT: tl.constexpr, INTERPRETER: tl.constexpr):
    """Round fp32 ``x`` to ``DT`` (nearest even) and return it as fp32: one SPEC rounding point."""
    if INTERPRETER and DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _rope_cos_sin(
    pos_ptr, inv_freq_ptr, b, s_idx, s_mask, stride_pos_b, stride_pos_s, stride_inv_freq,
    OUT_DTYPE: tl.constexpr, HALF: tl.constexpr, INTERPRETER: tl.constexpr, TRIG: tl.constexpr,
):
    """[BLOCK_S, HALF] cos/sin as fp32 holding values rounded to ``OUT_DTYPE`` (SPEC step 2)."""
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pos_b + s_idx.to(tl.int64) * stride_pos_s,
                  mask=s_mask, other=0)
    return _cos_sin_at(pos, inv_freq_ptr, stride_inv_freq, OUT_DTYPE, HALF, INTERPRETER, TRIG)


@triton.jit
def _cos_sin_at(pos, inv_freq_ptr, stride_inv_freq, OUT_DTYPE: tl.constexpr, HALF: tl.constexpr,
                INTERPRETER: tl.constexpr, TRIG: tl.constexpr):
    """cos/sin of ``float32(pos)[:, None] * inv_freq[None, :]`` for integer positions [N]
    -> [N, HALF]."""
    inv = tl.load(inv_freq_ptr + tl.arange(0, HALF) * stride_inv_freq).to(tl.float32)
    return _cos_sin(pos.to(tl.float32)[:, None] * inv[None, :], OUT_DTYPE, INTERPRETER, TRIG)


@triton.jit
def _cos_sin(angle, OUT_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr, TRIG: tl.constexpr):
    """cos/sin of fp32 angles, as fp32 holding values rounded to ``OUT_DTYPE``."""
    if INTERPRETER or TRIG == 1:  # TRIG: experiment hook (0 = accurate; 1, 2 = cost probes)
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    elif TRIG == 2:
        cos = angle * 0.0 + 1.0
        sin = angle * 0.0
    else:
        # Angles reach 2**18 rad: the hardware sin/cos approximations are wrong there, the
        # libdevice versions do full range reduction (the same code torch's CUDA cos runs).
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    return _round(cos, OUT_DTYPE, INTERPRETER), _round(sin, OUT_DTYPE, INTERPRETER)


@triton.jit
def _load_halves(x_ptr, x_off, x_half_step, mask, EVICTION: tl.constexpr):
    """Both halves of a [BLOCK_H, BLOCK_S, HALF]-halved tile of rows, upcast to fp32."""
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0, eviction_policy=EVICTION)
    x2 = tl.load(x_ptr + x_off + x_half_step, mask=mask, other=0.0, eviction_policy=EVICTION)
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _load_weight_halves(w_ptr, stride_w, HALF: tl.constexpr, W_OFFSET: tl.constexpr = 0.0):
    """Both halves of a norm weight as fp32 [1, 1, HALF] (``W_OFFSET + w``: Gemma style).

    Callers load these with the rows, before any sin/cos work: loaded inside the math they
    would sit behind its layout-conversion barriers, a serial memory round trip or two per
    program."""
    d = tl.arange(0, HALF)[None, None, :]
    w1 = tl.load(w_ptr + d * stride_w).to(tl.float32)
    w2 = tl.load(w_ptr + (d + HALF) * stride_w).to(tl.float32)
    if W_OFFSET != 0.0:
        w1 = w1 + W_OFFSET
        w2 = w2 + W_OFFSET
    return w1, w2


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, DT: tl.constexpr, HALF: tl.constexpr,
               INTERPRETER: tl.constexpr, HF_NORM: tl.constexpr):
    """RMSNorm + NeoX rotation of the two halves of a tile of rows; returns both halves in DT.

    ``w1``, ``w2``: the fp32 weight halves from :func:`_load_weight_halves`. Rounding points
    follow SPEC §1: one rounding after the fp32 weight multiply (or, with ``HF_NORM``, one
    before and one after a weight multiply in DT), one after each rotation product and one
    after each sum.
    """
    # 1/D is a power of two for every supported head_dim, so this equals torch's sum * (1/D).
    mean_sq = (_row_sum(x1 * x1) + _row_sum(x2 * x2)) * (0.5 / HALF)
    rstd = tl.math.rsqrt(mean_sq + eps)[:, :, None]
    if HF_NORM:
        # HF's Qwen3RMSNorm rounds the normalized row, then multiplies by the weight in DT.
        n1 = _round(w1 * _round(x1 * rstd, DT, INTERPRETER), DT, INTERPRETER)
        n2 = _round(w2 * _round(x2 * rstd, DT, INTERPRETER), DT, INTERPRETER)
    else:
        n1 = _round(w1 * (x1 * rstd), DT, INTERPRETER)
        n2 = _round(w2 * (x2 * rstd), DT, INTERPRETER)
    # Each product of two DT values is exact in fp32, so round(fp32 product) is the DT product;
    # LLVM emits these as native bf16/fp16 multiplies. fp fusion is off at launch: an FMA
    # would skip the rounding of a product.
    o1 = _round(n1 * cos, DT, INTERPRETER) - _round(n2 * sin, DT, INTERPRETER)
    o2 = _round(n2 * cos, DT, INTERPRETER) + _round(n1 * sin, DT, INTERPRETER)
    # The final cast is exact once _round has run: the interpreter's truncating cast is safe.
    o1 = _round(o1, DT, INTERPRETER).to(DT)
    o2 = _round(o2, DT, INTERPRETER).to(DT)
    return o1, o2


@triton.jit
def qknorm_rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, cache_pos_ptr,
    q_w_ptr, k_w_ptr, inv_freq_ptr, q_out_ptr, k_out_ptr,
    eps, S, Hq, Hkv, L,
    stride_q_b, stride_q_h, stride_q_s, stride_q_d,
    stride_k_b, stride_k_h, stride_k_s, stride_k_d,
    stride_v_b, stride_v_h, stride_v_s, stride_v_d,
    stride_qo_b, stride_qo_h, stride_qo_s, stride_qo_d,
    stride_ko_b, stride_ko_h, stride_ko_s, stride_ko_d,
    stride_kc_b, stride_kc_h, stride_kc_l, stride_kc_d,
    stride_vc_b, stride_vc_h, stride_vc_l, stride_vc_d,
    stride_pos_b, stride_pos_s, stride_cache_pos, stride_q_w, stride_k_w, stride_inv_freq,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERPRETER: tl.constexpr, EVICTION: tl.constexpr,
    HF_NORM: tl.constexpr, TRIG: tl.constexpr = 0,
):
    """Grid: (cdiv(S, BLOCK_S), cdiv(Hq, BLOCK_HQ) + cdiv(Hkv, BLOCK_HKV), B).

    Aliasing contract: every element a program stores was loaded by that same program first,
    so ``q_out`` may be ``q`` itself (and ``k_out`` ``k``); nothing else may overlap.
    """
    pid_s = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2)
    eps = tl.cast(eps, tl.float32)

    s_idx = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = s_idx < S
    s3 = s_idx[None, :, None]
    d3 = tl.arange(0, HALF)[None, None, :]
    n_q_blocks = (Hq + BLOCK_HQ - 1) // BLOCK_HQ  # not tl.cdiv: see _row_sum
    DT = q_ptr.dtype.element_ty

    # In each branch every load is issued before the sin/cos work, so the row loads and the
    # position loads share one DRAM round trip (decode is latency-bound).
    # Triton needs a value assigned in both branches to have one type, so names differ by branch.
    if pid_h < n_q_blocks:
        hq = pid_h * BLOCK_HQ + tl.arange(0, BLOCK_HQ)[:, None, None]
        q_mask = (hq < Hq) & (s3 < S)
        w1, w2 = _load_weight_halves(q_w_ptr, stride_q_w, HALF)
        q_off = _offsets(b, hq, s3, d3, stride_q_b, stride_q_h, stride_q_s, stride_q_d)
        q1, q2 = _load_halves(q_ptr, q_off, HALF * stride_q_d, q_mask, EVICTION)
        cos, sin = _rope_cos_sin(pos_ptr, inv_freq_ptr, b, s_idx, s_mask, stride_pos_b,
                                 stride_pos_s, stride_inv_freq, DT, HALF, INTERPRETER, TRIG)
        q1, q2 = _norm_rope(q1, q2, w1, w2, cos[None, :, :], sin[None, :, :], eps, DT, HALF,
                            INTERPRETER, HF_NORM)
        qo_off = _offsets(b, hq, s3, d3, stride_qo_b, stride_qo_h, stride_qo_s, stride_qo_d)
        tl.store(q_out_ptr + qo_off, q1, mask=q_mask, eviction_policy=EVICTION)
        tl.store(q_out_ptr + qo_off + HALF * stride_qo_d, q2, mask=q_mask, eviction_policy=EVICTION)
    else:
        hk = (pid_h - n_q_blocks) * BLOCK_HKV + tl.arange(0, BLOCK_HKV)[:, None, None]
        k_mask = (hk < Hkv) & (s3 < S)
        w1, w2 = _load_weight_halves(k_w_ptr, stride_k_w, HALF)
        k_off = _offsets(b, hk, s3, d3, stride_k_b, stride_k_h, stride_k_s, stride_k_d)
        k1, k2 = _load_halves(k_ptr, k_off, HALF * stride_k_d, k_mask, EVICTION)
        d_full = tl.arange(0, 2 * HALF)[None, None, :]
        v_off = _offsets(b, hk, s3, d_full, stride_v_b, stride_v_h, stride_v_s, stride_v_d)
        v = tl.load(v_ptr + v_off, mask=k_mask, other=0.0, eviction_policy=EVICTION)
        # Cache rows outside [0, L) (e.g. -1 padding) are skipped, never written out of bounds.
        row = tl.load(cache_pos_ptr + s_idx.to(tl.int64) * stride_cache_pos, mask=s_mask, other=-1)
        cos, sin = _rope_cos_sin(pos_ptr, inv_freq_ptr, b, s_idx, s_mask, stride_pos_b,
                                 stride_pos_s, stride_inv_freq, DT, HALF, INTERPRETER, TRIG)
        k1, k2 = _norm_rope(k1, k2, w1, w2, cos[None, :, :], sin[None, :, :], eps, DT, HALF,
                            INTERPRETER, HF_NORM)
        ko_off = _offsets(b, hk, s3, d3, stride_ko_b, stride_ko_h, stride_ko_s, stride_ko_d)
        tl.store(k_out_ptr + ko_off, k1, mask=k_mask, eviction_policy=EVICTION)
        tl.store(k_out_ptr + ko_off + HALF * stride_ko_d, k2, mask=k_mask, eviction_policy=EVICTION)

        row3 = row[None, :, None]
        row_mask = k_mask & (row3 >= 0) & (row3 < L)
        kc_off = _offsets(b, hk, row3, d3, stride_kc_b, stride_kc_h, stride_kc_l, stride_kc_d)
        tl.store(k_cache_ptr + kc_off, k1, mask=row_mask, eviction_policy=EVICTION)
        tl.store(k_cache_ptr + kc_off + HALF * stride_kc_d, k2, mask=row_mask,
                 eviction_policy=EVICTION)
        vc_off = _offsets(b, hk, row3, d_full, stride_vc_b, stride_vc_h, stride_vc_l, stride_vc_d)
        tl.store(v_cache_ptr + vc_off, v, mask=row_mask, eviction_policy=EVICTION)
