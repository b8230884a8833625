"""Host side of the token-major / paged-cache op: argument checks, tiling and the launch."""

from __future__ import annotations

import functools
import math
import numbers

import torch
import triton

from ..._interpret import interpreting
from .._direct_launch import PlanCache, device_of, fast_path_ok, outputs, signature
from ..qknorm_rope_cache.launcher import (
    ACTIVATION_DTYPES, INDEX_DTYPES, NORM_ROUNDINGS, _shape, _tensor, outputs_like,
)
from .kernel import qknorm_rope_paged_kernel
from .reference import FP8_MAX

__all__ = ["fused_qk_norm_rope_paged", "fused_qkv_norm_rope_paged", "split_packed_qkv"]

HEAD_DIMS = (64, 128, 256, 512)
CACHE_LAYOUTS = ("NHD", "HND")
ROTARY_STYLES = ("neox", "gptj")


def split_packed_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """Views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of a packed projection output
    ``qkv`` [T, (Hq + 2 Hkv) * D] (no copy)."""
    _tensor("qkv", qkv, 2, ACTIVATION_DTYPES)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must have shape [T, {width}] ((Hq + 2 Hkv) * D), "
                         f"got {list(qkv.shape)}")
    T = qkv.shape[0]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=1)
    return (q.view(T, num_q_heads, head_dim), k.view(T, num_kv_heads, head_dim),
            v.view(T, num_kv_heads, head_dim))


def _scale_tensor(name, scale, cache, num_kv_heads, device):
    """The FP8 scale as a device fp32 tensor of 1 or Hkv elements (cached for Python floats)."""
    if cache.dtype not in FP8_MAX:
        if scale is not None:
            raise ValueError(f"{name} is only used with a float8_e4m3fn cache, got a "
                             f"{str(cache.dtype).removeprefix('torch.')} cache")
        return None
    if scale is None:
        raise ValueError(f"{name} is required for a float8_e4m3fn cache (stored = "
                         f"saturate(x / {name}))")
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be finite and > 0, got {scale}")
        return _scalar_on(float(scale), device)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a Python float or a float32 tensor")
    if scale.numel() not in (1, num_kv_heads) or scale.device != device:
        raise ValueError(f"{name} must have 1 or Hkv={num_kv_heads} elements on {device}, got "
                         f"shape {list(scale.shape)} on {scale.device}")
    return scale.reshape(-1).contiguous()


@functools.lru_cache(maxsize=64)
def _scalar_on(value: float, device: torch.device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _check(query, key, value, positions, key_cache, value_cache, slot_mapping, q_norm_weight,
           k_norm_weight, inv_freq, rms_norm_eps, cache_layout, rotary_style, rotary_dim,
           norm_weight_offset, norm_rounding):
    _tensor("query", query, 3, ACTIVATION_DTYPES)
    act = query.dtype
    for name, x in (("key", key), ("value", value)):
        _tensor(name, x, 3, (act,))
    cache_dtypes = (act, *FP8_MAX)
    _tensor("key_cache", key_cache, 4, cache_dtypes)
    _tensor("value_cache", value_cache, 4, cache_dtypes)
    _tensor("positions", positions, 1, INDEX_DTYPES)
    _tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    _tensor("q_norm_weight", q_norm_weight, 1, (act,))
    _tensor("k_norm_weight", k_norm_weight, 1, (act,))
    _tensor("inv_freq", inv_freq, 1, (torch.float32,))
    if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, numbers.Real) or not (
            math.isfinite(rms_norm_eps) and rms_norm_eps >= 0):
        raise ValueError(f"rms_norm_eps must be a finite float >= 0, got {rms_norm_eps!r}")
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
    if rotary_style not in ROTARY_STYLES:
        raise ValueError(f"rotary_style must be one of {ROTARY_STYLES}, got {rotary_style!r}")
    if norm_rounding not in NORM_ROUNDINGS:
        raise ValueError(f"norm_rounding must be one of {NORM_ROUNDINGS}, got {norm_rounding!r}")
    if norm_weight_offset and norm_rounding == "hf":
        raise ValueError("norm_weight_offset (Gemma-style 1 + w) needs norm_rounding="
                         "'weight_fp32', the rounding of the models that use it")

    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if D not in HEAD_DIMS:
        raise ValueError(f"query head_dim must be one of {HEAD_DIMS}, got {D}")
    if T < 1 or Hq < 1 or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key heads ({Hkv}) "
                         f"and T ({T}) >= 1")
    rot = D if rotary_dim is None else rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, int) or not (2 <= rot <= D and rot % 2 == 0):
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim={D}], got {rotary_dim!r}")
    _shape("key", key, (T, Hkv, D), "[T, Hkv, D] matching query's T and D")
    _shape("value", value, (T, Hkv, D), "[T, Hkv, D] like key")
    _shape("positions", positions, (T,), "[T]")
    _shape("slot_mapping", slot_mapping, (T,), "[T]")
    _shape("q_norm_weight", q_norm_weight, (D,), "[D]")
    _shape("k_norm_weight", k_norm_weight, (D,), "[D]")
    _shape("inv_freq", inv_freq, (rot // 2,), "[rotary_dim/2]")
    nb = key_cache.shape[0]
    bs = key_cache.shape[1] if cache_layout == "NHD" else key_cache.shape[2]
    want = (nb, bs, Hkv, D) if cache_layout == "NHD" else (nb, Hkv, bs, D)
    _shape("key_cache", key_cache, want,
           f"{cache_layout}: [num_blocks, block_size, Hkv, D]" if cache_layout == "NHD"
           else f"{cache_layout}: [num_blocks, Hkv, block_size, D]")
    _shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    for name, x in (("key", key), ("value", value), ("positions", positions),
                    ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping), ("q_norm_weight", q_norm_weight),
                    ("k_norm_weight", k_norm_weight), ("inv_freq", inv_freq)):
        if x.device != query.device:
            raise ValueError(f"{name} is on {x.device} but query is on {query.device}: all "
                             "inputs must be on one device")
    if query.device.type != "cuda" and not interpreting():
        raise ValueError(f"the fused kernel needs CUDA tensors, got query on {query.device}")
    return T, Hq, Hkv, D, rot, nb, bs


def fused_qk_norm_rope_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    rms_norm_eps: float,
    *,
    cache_layout: str = "NHD",
    rotary_style: str = "neox",
    rotary_dim: int | None = None,
    norm_weight_offset: float = 0.0,
    norm_rounding: str = "weight_fp32",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major QK RMSNorm + RoPE + paged K/V cache write, in one launch (serving layouts).

    Args:
        query: [T, Hq, D] bf16/fp16, any strides (e.g. from :func:`split_packed_qkv`);
            D in {64, 128, 256, 512}.
        key, value: [T, Hkv, D], dtype of ``query``; ``Hq % Hkv == 0``.
        positions: [T] int32/int64 rotary position of each token (sequences may sit anywhere).
        key_cache, value_cache: paged caches, ``cache_layout="NHD"``: [num_blocks, block_size,
            Hkv, D]; ``"HND"``: [num_blocks, Hkv, block_size, D]; dtype of ``query`` or
            ``torch.float8_e4m3fn``; separate tensors or views of one allocation. A contiguous
            per-sequence cache [B, Hkv, L, D] is ``"HND"`` with block_size L: slot ``b * L + row``.
        slot_mapping: [T] int32/int64; token t goes to block ``slot // block_size``, offset
            ``slot % block_size``. Slots < 0 (CUDA-graph padding) or past the cache are skipped.
        q_norm_weight, k_norm_weight: [D], dtype of ``query``.
        inv_freq: [rotary_dim/2] float32.
        rms_norm_eps: RMSNorm epsilon.
        cache_layout: ``"NHD"`` (vLLM's default) or ``"HND"``.
        rotary_style: ``"neox"`` (rotate halves) or ``"gptj"`` (interleaved pairs 2i, 2i+1).
        rotary_dim: rotate only the first ``rotary_dim`` dims (even, <= D); the rest of each
            row is normalised and passed through. Default D.
        norm_weight_offset: norm weight is ``offset + w`` in fp32 (Gemma: 1.0).
        norm_rounding: ``"weight_fp32"`` or ``"hf"``, as in
            :func:`qkrope.fused_rope_with_qk_norm_and_kv_cache_update`.
        k_scale, v_scale: FP8 caches only, required there: Python float, or float32 tensor of
            1 (per tensor) or Hkv (per head) elements. Stored value = saturate(x / scale) to
            ±448 (vLLM's convention); read back as stored * scale.
        query_out, key_out: optional preallocated outputs of the input shapes; ``query_out``
            may be ``query`` itself (and ``key_out`` ``key``).

    Returns:
        ``(query_rotated [T, Hq, D], key_rotated [T, Hkv, D])``; the caches are written in place.
    """
    tensors = (query, key, value, positions, key_cache, value_cache, slot_mapping, q_norm_weight,
               k_norm_weight, inv_freq)
    compiling = torch.compiler.is_compiling()
    scales = tuple(float(s) if isinstance(s, numbers.Real) and not isinstance(s, bool) else s
                   for s in (k_scale, v_scale))
    # The signature: Python-float scales among the options, scale tensors among the tensors.
    key_of_call = None
    addresses = []
    if not compiling and all(s is None or isinstance(s, (float, torch.Tensor)) for s in scales):
        key_of_call = signature(
            (cache_layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
             *(s if isinstance(s, float) else None for s in scales)),
            (*tensors, query_out, key_out,
             *(s if isinstance(s, torch.Tensor) else None for s in scales)), addresses)
    plan = _PLANS.find(key_of_call) if fast_path_ok() else None
    if plan is not None and type(rms_norm_eps) is float and 0.0 <= rms_norm_eps < math.inf:
        query_out, key_out, *addresses[10:] = outputs(query, key, query_out, key_out)
        addresses += [(inv_freq if s is None else _device_scale(s, query.device)).data_ptr()
                      for s in scales]
        plan.launch(addresses, rms_norm_eps)
        return query_out, key_out

    _, _, Hkv, _, rot, _, _ = _check(*tensors, rms_norm_eps, cache_layout, rotary_style,
                                     rotary_dim, norm_weight_offset, norm_rounding)
    k_sc = _scale_tensor("k_scale", scales[0], key_cache, Hkv, query.device)
    v_sc = _scale_tensor("v_scale", scales[1], value_cache, Hkv, query.device)
    if k_sc is not None and v_sc is not None and k_sc.numel() != v_sc.numel():
        raise ValueError("k_scale and v_scale must both be per-tensor or both per-head")
    query_out, key_out = outputs_like(query, key, query_out, key_out)
    if compiling:  # traced: the registered custom op (see registration.py)
        torch.ops.qkrope.qk_norm_rope_paged(
            *tensors, float(rms_norm_eps), query_out, key_out, cache_layout, rotary_style, rot,
            float(norm_weight_offset), norm_rounding, k_sc, v_sc)
    else:
        grid, args, meta, compiled = launch_paged(
            *tensors, rms_norm_eps, query_out, key_out, cache_layout, rotary_style, rot,
            norm_weight_offset, norm_rounding, k_sc, v_sc)
        # Per call: 10 input tensors, 2 outputs, 2 scale tensors and rms_norm_eps.
        _PLANS.remember(key_of_call, qknorm_rope_paged_kernel, compiled, grid, args, meta, 15,
                        query.get_device())
    return query_out, key_out


_PLANS = PlanCache()


def _device_scale(scale, device) -> torch.Tensor:
    """The kernel's view of an FP8 scale already checked for this signature."""
    if isinstance(scale, float):
        return _scalar_on(scale, device)
    return scale.reshape(-1).contiguous()


def launch_paged(query, key, value, positions, key_cache, value_cache, slot_mapping,
                 q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out,
                 cache_layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                 k_scale, v_scale):
    """Launch through Triton on checked arguments (scales as device tensors or None); returns
    ``(grid, args, meta, compiled kernel)`` for the direct-launch cache."""
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    nb = key_cache.shape[0]
    bs = key_cache.shape[1] if cache_layout == "NHD" else key_cache.shape[2]
    interpret = interpreting()
    block_h, block_t, num_warps = _tile(T, Hq, Hkv, D, interpret)
    grid = (triton.cdiv(T, block_t), triton.cdiv(Hq, block_h) + triton.cdiv(Hkv, block_h))
    # The cache's (block, offset, head, dim) strides; the layout is nothing more than these.
    kc_s = key_cache.stride() if cache_layout == "NHD" else _hnd(key_cache.stride())
    vc_s = value_cache.stride() if cache_layout == "NHD" else _hnd(value_cache.stride())
    per_head = any(sc is not None and sc.numel() > 1 for sc in (k_scale, v_scale))
    unused = inv_freq  # any valid pointer for an absent scale; the kernel never reads it
    args = [
        query, key, value, positions, key_cache, value_cache, slot_mapping,
        q_norm_weight, k_norm_weight, inv_freq, query_out, key_out,
        unused if k_scale is None else k_scale, unused if v_scale is None else v_scale,
        float(rms_norm_eps), T, Hq, Hkv, bs, nb * bs,
        *query.stride(), *key.stride(), *value.stride(), *query_out.stride(),
        *key_out.stride(), *kc_s, *vc_s,
        positions.stride(0), slot_mapping.stride(0), q_norm_weight.stride(0),
        k_norm_weight.stride(0), inv_freq.stride(0),
    ]
    meta = dict(D=D, ROT=rotary_dim, GPTJ=rotary_style == "gptj", HF_NORM=norm_rounding == "hf",
                W_OFFSET=float(norm_weight_offset), BLOCK_H=block_h, BLOCK_T=block_t,
                K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
                PER_HEAD_SCALE=per_head, INTERPRETER=interpret, num_warps=num_warps,
                enable_fp_fusion=False)
    with device_of(query):  # Triton launches on the current device
        compiled = qknorm_rope_paged_kernel[grid](*args, **meta)
    return grid, args, meta, compiled


def _hnd(stride):
    """HND [num_blocks, Hkv, block_size, D] strides reordered to (block, offset, head, dim)."""
    return stride[0], stride[2], stride[1], stride[3]


@functools.lru_cache(maxsize=1024)
def _tile(T: int, Hq: int, Hkv: int, D: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_T, num_warps): one token per program on the GPU (measured best for the
    [B, H, S, D] kernel); few, large programs in the interpreter."""
    if interpret:
        return triton.next_power_of_2(max(Hq, Hkv)), min(triton.next_power_of_2(T), 16), 4
    block_h = min(triton.next_power_of_2(Hq), max(1, 2048 // D))
    return block_h, 1, 2 if D <= 256 else 4


def fused_qkv_norm_rope_paged(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                              positions, key_cache, value_cache, slot_mapping, q_norm_weight,
                              k_norm_weight, inv_freq, rms_norm_eps, **kwargs):
    """:func:`fused_qk_norm_rope_paged` on a packed projection output ``qkv``
    [T, (Hq + 2 Hkv) * D] (D from ``q_norm_weight``); same keywords and returns."""
    _tensor("q_norm_weight", q_norm_weight, 1, ACTIVATION_DTYPES)
    q, k, v = split_packed_qkv(qkv, num_q_heads, num_kv_heads, q_norm_weight.shape[-1])
    return fused_qk_norm_rope_paged(q, k, v, positions, key_cache, value_cache, slot_mapping,
                                    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
                                    **kwargs)
