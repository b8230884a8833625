"""Host side of the op after its checks (``checks.py``): two thin layout adapters, one tile
picker and one launch, shared by both entry points; it checks nothing (the registered op's body
runs it on checked arguments) but, in Triton's interpreter, what the kernel's device assert
would (an ``append=True`` running length)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from ..._interpret import interpreting
from .._launch import KernelLauncher
from .._overlap import extent
from .checks import Options
from .kernel import qknorm_rope_kernel, rope_cos_sin_kernel
from .validation import check_room

__all__ = ["TileConfig", "PER_CALL", "pick_config", "launch", "LAUNCHER", "APPEND_LAUNCHER",
           "wide_offsets",
           "saturating_fp8_cvt", "COS_SIN_LAUNCHER", "launch_cos_sin"]

#: The kernel parameters that change from call to call, in the order the fast path passes them
#: (``KernelLauncher.fast_call``): the input tensors' addresses, the outputs', then eps.
PER_CALL = ("q_ptr", "k_ptr", "v_ptr", "pos_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr",
            "q_w_ptr", "k_w_ptr", "inv_freq_ptr", "k_scale_ptr", "v_scale_ptr", "q_scale_ptr",
            "k_scale_cache_ptr", "v_scale_cache_ptr", "q_out_ptr", "k_out_ptr", "eps")
_WRITTEN = ("k_cache_ptr", "v_cache_ptr", "k_scale_cache_ptr", "v_scale_cache_ptr",
            "q_out_ptr", "k_out_ptr")
_IN_PLACE = (("q_out_ptr", "q_ptr"), ("k_out_ptr", "k_ptr"))
LAUNCHER = KernelLauncher(qknorm_rope_kernel, PER_CALL, written=_WRITTEN, in_place=_IN_PLACE,
                          outputs=_IN_PLACE)
#: The same kernel for ``append=True`` calls, which also write their running length (the
#: ``slot_ptr`` tensor): its plans, overlap rule and version bumps say so, and it serves the op
#: whose schema declares that write (``qkrope::qknorm_rope_append``).
APPEND_LAUNCHER = KernelLauncher(qknorm_rope_kernel, PER_CALL, written=(*_WRITTEN, "slot_ptr"),
                                 in_place=_IN_PLACE, outputs=_IN_PLACE)
#: The rotary table's kernel: its per-call parameters are its four tensors (the caller
#: allocates the tables, whose shape is no input's).
COS_SIN_LAUNCHER = KernelLauncher(rope_cos_sin_kernel,
                                  ("pos_ptr", "inv_freq_ptr", "cos_ptr", "sin_ptr"),
                                  written=("cos_ptr", "sin_ptr"))


# --------------------------------------------------------------------------------------------
# tiling
# --------------------------------------------------------------------------------------------
class TileConfig(NamedTuple):
    """Tile shape and launch width for one problem shape."""

    block_hq: int    # query heads per program
    block_hkv: int   # key/value heads per program
    block_t: int     # tokens per program
    num_warps: int


# Measured on the H200 (docs/perf-notes.md, runs 3-4 and "Small batches: one head per
# program"): tiles of one token and few warps win at every size (many small programs keep more
# loads in flight per SM than a few large ones). One head per program only pays while a call has
# so few tokens that its tiles would leave SMs idle; past that, a program per head repeats the
# tile's trig and address work for every head.
ONE_HEAD_MAX_TOKENS = 4
# Quantised stores that lengthen a program: up to these many tokens, more, narrower programs
# finish a call sooner (docs/design.md, "Narrower tiles for quantised stores"). INT8
# per-token-head caches' K/V programs (amax, scale, codes rounded half away from zero) take at
# most 4 KV heads up to NARROW_MAX_TOKENS; an FP8 query beside per-token-head caches makes the
# Q programs the slow half (16-byte stores in a layout of their own): at most 8 query heads and
# 4 KV heads, but only up to NARROW_Q8_MAX_TOKENS: past that, the narrow tiles' repeated
# per-token work (trig, addressing, for every 8 heads instead of 16) costs an H200 more than
# their shorter programs gain.
NARROW_MAX_TOKENS = 512
NARROW_Q8_MAX_TOKENS = 128


@functools.lru_cache(maxsize=1024)
def pick_config(B: int, T: int, Hq: int, Hkv: int, D: int, interpret: bool,
                int8_cache: bool = False, fp8_query_pth: bool = False) -> TileConfig:
    """Tile shape for ``B`` x ``T`` tokens (``int8_cache``: INT8 per-token-head caches;
    ``fp8_query_pth``: an FP8 query output beside per-token-head caches); cached per shape so
    the hot path does no search."""
    if interpret:
        # ~5 ms per program instance in the interpreter: few programs, whole head groups.
        return TileConfig(triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv),
                          min(triton.next_power_of_2(T), 32), 4)
    block_hq = min(triton.next_power_of_2(Hq), max(1, 2048 // D))
    block_hkv = min(triton.next_power_of_2(Hkv), max(1, 1024 // D))
    if int8_cache and B * T <= NARROW_MAX_TOKENS:
        block_hkv = min(block_hkv, 4)
    if fp8_query_pth and B * T <= NARROW_Q8_MAX_TOKENS:
        block_hq = min(block_hq, 8)
        block_hkv = min(block_hkv, 4)
    programs = B * T * (triton.cdiv(Hq, block_hq) + triton.cdiv(Hkv, block_hkv))
    if programs < _num_sms() and (B * T <= ONE_HEAD_MAX_TOKENS or D > 128):
        # A decode step of a few tokens: one head per program spreads it over the chip. Tiles
        # of heads wider than 128 (Qwen3.5's partial rotary: partner loads, trig per element)
        # lose to it for as long as they leave SMs idle.
        return TileConfig(1, 1, 1, 1)
    return TileConfig(block_hq, block_hkv, 1, 2 if D <= 256 else 4)


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# --------------------------------------------------------------------------------------------
# the launch (the registered op's body)
# --------------------------------------------------------------------------------------------
def _bhsd_args(query, key_cache, value_cache, position_ids):
    """[B, H, S, D]: batch strides as they are; one cache row per token and batch element.
    Returns ``(kernel args, (B, T), (b, h, t, d) strides of an activation)``."""
    B, S = query.shape[0], query.shape[2]
    mrope = position_ids.dim() == 3
    return dict(
        T=S, rows_per_batch=key_cache.shape[2], block_size=1,
        stride_kc_b=key_cache.stride(0), stride_kc_blk=0, stride_kc_row=key_cache.stride(2),
        stride_kc_h=key_cache.stride(1), stride_kc_d=key_cache.stride(3),
        stride_vc_b=value_cache.stride(0), stride_vc_blk=0, stride_vc_row=value_cache.stride(2),
        stride_vc_h=value_cache.stride(1), stride_vc_d=value_cache.stride(3),
        stride_pos_r=position_ids.stride(0) if mrope else 0,
        # [1, S] positions broadcast over the batch through a zero batch stride.
        stride_pos_b=position_ids.stride(-2) if position_ids.shape[-2] == B else 0,
        stride_pos_t=position_ids.stride(-1),
    ), (B, S), lambda x: x.stride()


def _paged_args(layout: str, key_cache, value_cache, positions):
    """Token-major: one "batch" (batch strides 0); the cache layout lives in its strides.
    Returns as :func:`_bhsd_args`."""
    nhd = layout == "NHD"
    bs = key_cache.shape[1] if nhd else key_cache.shape[2]

    def blk_row_h_d(c):  # the cache's (block, row in block, head, dim) strides
        s = c.stride()
        return s if nhd else (s[0], s[2], s[1], s[3])

    kc, vc = blk_row_h_d(key_cache), blk_row_h_d(value_cache)
    mrope = positions.dim() == 2
    return dict(
        T=positions.shape[-1], rows_per_batch=key_cache.shape[0] * bs, block_size=bs,
        stride_kc_b=0, stride_kc_blk=kc[0], stride_kc_row=kc[1], stride_kc_h=kc[2],
        stride_kc_d=kc[3],
        stride_vc_b=0, stride_vc_blk=vc[0], stride_vc_row=vc[1], stride_vc_h=vc[2],
        stride_vc_d=vc[3],
        stride_pos_r=positions.stride(0) if mrope else 0, stride_pos_b=0,
        stride_pos_t=positions.stride(-1),
    ), (1, positions.shape[-1]), lambda x: (0, x.stride(1), x.stride(0), x.stride(2))


def launch(query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
           k_norm_weight, inv_freq, k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache,
           query_out, key_out, rms_norm_eps, opts: Options):
    """Launch the kernel on checked arguments (``opts`` canonical, scales as device tensors or
    None, memory overlap refused by ``checks.check_overlap``); returns ``(compiled kernel or
    None, grid, args, meta)``."""
    if opts.layout == "bhsd":
        args, (B, T), bhtd = _bhsd_args(query, key_cache, value_cache, positions)
    else:
        args, (B, T), bhtd = _paged_args(opts.layout, key_cache, value_cache, positions)
    Hq, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]  # [B, H, S, D] or [T, H, D]
    qo_scaled, k_dyn = query_out.dtype != query.dtype, k_scale_cache is not None
    cfg = pick_config(B, T, Hq, Hkv, D, interpreting(), key_cache.dtype == torch.int8,
                      qo_scaled and k_dyn)
    grid = (triton.cdiv(T, cfg.block_t),
            triton.cdiv(Hq, cfg.block_hq) + triton.cdiv(Hkv, cfg.block_hkv), B)
    unused = inv_freq  # any valid pointer for an absent scale; the kernel never reads it
    for name, x in (("q", query), ("k", key), ("v", value), ("qo", query_out), ("ko", key_out)):
        args.update(zip((f"stride_{name}_b", f"stride_{name}_h", f"stride_{name}_t",
                         f"stride_{name}_d"), bhtd(x)))
    args.update(
        q_ptr=query, k_ptr=key, v_ptr=value, pos_ptr=positions, k_cache_ptr=key_cache,
        v_cache_ptr=value_cache, slot_ptr=slots, q_w_ptr=q_norm_weight, k_w_ptr=k_norm_weight,
        inv_freq_ptr=inv_freq, q_out_ptr=query_out, k_out_ptr=key_out,
        k_scale_ptr=unused if k_scale is None else k_scale,
        v_scale_ptr=unused if v_scale is None else v_scale,
        q_scale_ptr=unused if q_scale is None else q_scale,
        k_scale_cache_ptr=unused if k_scale_cache is None else k_scale_cache,
        v_scale_cache_ptr=unused if v_scale_cache is None else v_scale_cache,
        **_scale_cache_strides("ksc", opts.layout, k_scale_cache),
        **_scale_cache_strides("vsc", opts.layout, v_scale_cache),
        eps=float(rms_norm_eps), Hq=Hq, Hkv=Hkv,
        stride_slot=0 if opts.append else slots.stride(0),
        stride_q_w=q_norm_weight.stride(0), stride_k_w=k_norm_weight.stride(0),
        stride_inv_freq=inv_freq.stride(0),
        # A per-tensor scale is read by every head through a zero stride.
        stride_k_scale=_scale_stride(k_scale), stride_v_scale=_scale_stride(v_scale),
        stride_q_scale=_scale_stride(q_scale),
    )
    section = opts.mrope_section or (0, 0, 0)
    meta = dict(
        D=D, ROT=opts.rotary_dim or D, GPTJ=opts.rotary_style == "gptj",
        HF_NORM=opts.norm_rounding == "hf", W_OFFSET=float(opts.norm_weight_offset),
        COS_SIN_SCALE=float(opts.cos_sin_scale),
        MROPE=0 if opts.mrope_section is None else (2 if opts.mrope_interleaved else 1),
        SEC_T=section[0], SEC_H=section[1], SEC_W=section[2], PAGED=opts.layout != "bhsd",
        # FP8 stores: the caches, and the quantised outputs (docs/spec.md, R4).
        K_SCALED=key_cache.dtype != query.dtype and not k_dyn,
        V_SCALED=value_cache.dtype != query.dtype and v_scale_cache is None,
        QO_SCALED=qo_scaled, KO_SCALED=key_out.dtype != query.dtype,
        K_DYN=k_dyn, V_DYN=v_scale_cache is not None,
        BLOCK_HQ=cfg.block_hq, BLOCK_HKV=cfg.block_hkv, BLOCK_T=cfg.block_t,
        APPEND=opts.append, INTERPRETER=interpreting(),
        SAT_CVT=saturating_fp8_cvt(query.device),
        WIDE=wide_offsets(query, key, value, positions, key_cache, value_cache, slots,
                          q_norm_weight, k_norm_weight, inv_freq, k_scale, v_scale, q_scale,
                          k_scale_cache, v_scale_cache, query_out, key_out),
        # The rounding points forbid contracting a product and a sum into one FMA.
        enable_fp_fusion=False, num_warps=cfg.num_warps)
    if opts.append:
        if interpreting():
            # The device assert's check, which the interpreter skips: on the host (its tensors
            # are on the CPU: no sync).
            check_room(slots, T, args["rows_per_batch"], "cache_position", IndexError)
        else:
            # The running length's device assert: Triton compiles device_assert only in debug
            # mode, whose other effect, integer-overflow asserts, stays off (masked lanes may
            # wrap their int32 offsets: module docstring of kernel.py).
            meta.update(debug=True, sanitize_overflow=False)
    compiled = LAUNCHER.launch(grid, args, meta, query.device)
    return compiled, grid, args, meta


def saturating_fp8_cvt(device: torch.device) -> bool:
    """Whether Triton converts fp32 to FP8 on ``device`` with PTX ``cvt.rn.satfinite``
    (compute capability 8.9 on), which saturates and stores NaN as 0x7F itself, the bytes
    the oracle wants; the kernel then skips its own clamp and NaN select (docs/design.md, "FP8
    stores"). Not in the interpreter, whose cast truncates."""
    return device.type == "cuda" and not interpreting() and _capability(device) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def wide_offsets(*tensors) -> bool:
    """Whether the kernel must compute element offsets in int64: some tensor's largest element
    offset (from its data pointer) is 2**31 or more. A function of shapes and strides only, so
    fixed by the native fast path's signature."""
    for x in tensors:
        if x is not None:
            lo, hi = extent(x)  # strides are never negative: lo is the data pointer
            if hi - lo > 2**31 * x.element_size():
                return True
    return False


def _scale_cache_strides(name: str, layout: str, cache) -> dict:
    """(batch, block, row, head) strides of a per-token-head scale cache: [B, Hkv, L], NHD
    [num_blocks, block_size, Hkv] or HND [num_blocks, Hkv, block_size]; zeros without one."""
    if cache is None:
        s = (0, 0, 0, 0)
    elif layout == "bhsd":
        s = (cache.stride(0), 0, cache.stride(2), cache.stride(1))
    elif layout == "NHD":
        s = (0, cache.stride(0), cache.stride(1), cache.stride(2))
    else:
        s = (0, cache.stride(0), cache.stride(2), cache.stride(1))
    return dict(zip((f"stride_{name}_b", f"stride_{name}_blk", f"stride_{name}_row",
                     f"stride_{name}_h"), s))


def _scale_stride(scale) -> int:
    return 0 if scale is None or scale.numel() == 1 else scale.stride(-1)


def launch_cos_sin(positions, inv_freq, cos, sin, opts: Options):
    """Launch the rotary table's kernel on checked arguments (``checks.check_cos_sin``):
    ``positions`` [B, S] or [3, B, S], ``cos``/``sin`` [B, S, rotary_dim] contiguous. Returns
    ``(compiled kernel or None, grid, args, meta)``."""
    B, S = positions.shape[-2:]
    half = inv_freq.shape[0]
    block_t = min(triton.next_power_of_2(B * S), 64 if interpreting() else 16)
    grid = (triton.cdiv(B * S, block_t),)
    section = opts.mrope_section or (0, 0, 0)
    args = dict(pos_ptr=positions, inv_freq_ptr=inv_freq, cos_ptr=cos, sin_ptr=sin, T=B * S,
                S=S, stride_pos_r=positions.stride(0) if positions.dim() == 3 else 0,
                stride_pos_b=positions.stride(-2), stride_pos_s=positions.stride(-1),
                stride_inv_freq=inv_freq.stride(0))
    block_f = triton.next_power_of_2(half)
    meta = dict(HALF=half, BLOCK_F=block_f, BLOCK_T=block_t,
                COS_SIN_SCALE=float(opts.cos_sin_scale),
                MROPE=0 if opts.mrope_section is None else (2 if opts.mrope_interleaved else 1),
                SEC_T=section[0], SEC_H=section[1], SEC_W=section[2],
                INTERPRETER=interpreting(), num_warps=max(1, min(4, block_t * block_f // 256)))
    compiled = COS_SIN_LAUNCHER.launch(grid, args, meta, positions.device)
    return compiled, grid, args, meta
