"""Host side of the fused op: argument checks, tile choice, and the single kernel launch."""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch
import triton

from ..._interpret import interpreting
from .._direct_launch import (
    PlanCache, device_of, fast_path_ok, new_outputs, outputs, signature,
)
from .kernel import qknorm_rope_cache_kernel
from .reference import valid_cache_rows

__all__ = ["fused_rope_with_qk_norm_and_kv_cache_update", "check_inputs", "TileConfig",
           "pick_config"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
NORM_ROUNDINGS = ("weight_fp32", "hf")


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------
def _tensor(name: str, x, rank: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {str(x.dtype).removeprefix('torch.')}")
    return x


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)} ({what}), got {list(x.shape)}")


def check_inputs(
    query, key, value, position_ids, key_cache, value_cache, cache_position,
    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
) -> tuple[int, int, int, int, int, int]:
    """Validate the eleven op arguments; return ``(B, Hq, Hkv, S, D, L)``.

    Raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong rank, shape,
    device or value, each naming the argument and what was expected.
    """
    _tensor("query", query, 4, ACTIVATION_DTYPES)
    act = query.dtype
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):
        _tensor(name, x, 4, (act,))
    _tensor("position_ids", position_ids, 2, INDEX_DTYPES)
    _tensor("cache_position", cache_position, 1, INDEX_DTYPES)
    _tensor("q_norm_weight", q_norm_weight, 1, (act,))
    _tensor("k_norm_weight", k_norm_weight, 1, (act,))
    _tensor("inv_freq", inv_freq, 1, (torch.float32,))
    if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, numbers.Real):
        raise TypeError(f"rms_norm_eps must be a Python float, got {type(rms_norm_eps).__name__}")
    if not (math.isfinite(rms_norm_eps) and rms_norm_eps >= 0):
        raise ValueError(f"rms_norm_eps must be finite and >= 0, got {rms_norm_eps}")

    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"query head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if B < 1 or S < 1 or Hq < 1 or Hkv < 1:
        raise ValueError(f"query/key must be non-empty, got query {list(query.shape)}, "
                         f"key {list(key.shape)}")
    if B > 65535:  # the batch is the launch grid's z dimension
        raise ValueError(f"query batch must be <= 65535, got {B}; split the batch or use "
                         "qkrope.fused_qk_norm_rope_paged (token-major)")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key heads ({Hkv})")
    _shape("key", key, (B, Hkv, S, D), "[B, Hkv, S, D] matching query's B, S, D")
    _shape("value", value, (B, Hkv, S, D), "[B, Hkv, S, D] like key")
    L = key_cache.shape[2]
    _shape("key_cache", key_cache, (B, Hkv, L, D), "[B, Hkv, L, D] matching key's B, Hkv, D")
    _shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    if position_ids.shape[0] not in (1, B) or position_ids.shape[1] != S:
        raise ValueError(f"position_ids must have shape [{B}, {S}] or [1, {S}] ([B, S]), "
                         f"got {list(position_ids.shape)}")
    _shape("cache_position", cache_position, (S,), "[S]")
    _shape("q_norm_weight", q_norm_weight, (D,), "[D]")
    _shape("k_norm_weight", k_norm_weight, (D,), "[D]")
    _shape("inv_freq", inv_freq, (D // 2,), "[D/2]")

    device = query.device
    for name, x in (("key", key), ("value", value), ("position_ids", position_ids),
                    ("key_cache", key_cache), ("value_cache", value_cache),
                    ("cache_position", cache_position), ("q_norm_weight", q_norm_weight),
                    ("k_norm_weight", k_norm_weight), ("inv_freq", inv_freq)):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but query is on {device}: all inputs must "
                             "be on one device")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"the fused kernel needs CUDA tensors, got query on {device}; use "
                         "qkrope.reference on CPU, or set TRITON_INTERPRET=1 before importing "
                         "qkrope to run the kernel in Triton's interpreter")
    return B, Hq, Hkv, S, D, L


def _check_out(name: str, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have shape {list(like.shape)}, got {list(out.shape)}")
    if out.dtype != like.dtype:
        raise TypeError(f"{name} must be {like.dtype}, got {out.dtype}")
    if out.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {out.device}")
    return out


def outputs_like(query: torch.Tensor, key: torch.Tensor, query_out, key_out):
    """The caller's checked ``query_out``/``key_out``, or new contiguous ones like q and k."""
    if query_out is not None:
        _check_out("query_out", query_out, query)
    if key_out is not None:
        _check_out("key_out", key_out, key)
    return new_outputs(query, key, query_out, key_out)


def _check_cache_position_range(cache_position: torch.Tensor, L: int) -> None:
    bad = ~valid_cache_rows(cache_position, L)
    if bool(bad.any()):  # host sync: only on request
        first = int(cache_position[bad][0])
        raise ValueError(f"cache_position holds {first}, outside the cache [0, {L}) "
                         "(validate=True raises instead of skipping such rows)")


# --------------------------------------------------------------------------------------------
# tiling
# --------------------------------------------------------------------------------------------
class TileConfig(NamedTuple):
    """Tile shape and launch width for one problem shape."""

    block_hq: int    # query heads per program
    block_hkv: int   # key/value heads per program
    block_s: int     # tokens per program
    num_warps: int
    eviction: str = ""        # eviction policy of the streamed loads and stores
    trig: int = 0             # experiment hook only: 0 is the one correct setting


# Measured on the H200 (docs/perf-notes.md, runs 3-4): tiles of one token and few warps win at
# every size (many small programs keep more loads in flight per SM than a few large ones), and
# problems too small to fill the SMs want one head per program.
@functools.lru_cache(maxsize=1024)
def pick_config(B: int, Hq: int, Hkv: int, S: int, D: int, interpret: bool) -> TileConfig:
    """Tile shape for a problem; cached per shape so the hot path does no search."""
    if interpret:
        # ~5 ms per program instance in the interpreter: few programs, whole head groups.
        block_s = min(triton.next_power_of_2(S), 32)
        return TileConfig(triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv), block_s, 4)
    block_hq = min(triton.next_power_of_2(Hq), max(1, 2048 // D))
    block_hkv = min(triton.next_power_of_2(Hkv), max(1, 1024 // D))
    if B * S * (triton.cdiv(Hq, block_hq) + triton.cdiv(Hkv, block_hkv)) < _num_sms():
        # Fewer programs than SMs: one head per program spreads a decode step over the chip.
        return TileConfig(1, 1, 1, 1)
    return TileConfig(block_hq, block_hkv, 1, 2)


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------
def fused_rope_with_qk_norm_and_kv_cache_update(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cache_position: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    rms_norm_eps: float,
    *,
    inplace: bool = True,
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
    validate: bool = False,
    norm_rounding: str = "weight_fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm on Q and K, NeoX RoPE on both, and the K/V cache write, in one launch.

    Args:
        query: [B, Hq, S, D] bf16 or fp16, any strides (e.g. a view of a fused QKV projection).
        key: [B, Hkv, S, D], dtype of ``query``; ``Hq % Hkv == 0``; D in {64, 128, 256}.
        value: [B, Hkv, S, D], dtype of ``query``; copied unchanged into ``value_cache``.
        position_ids: [B, S] int32/int64 rotary positions; [1, S] and expanded views (batch
            stride 0) are accepted.
        key_cache, value_cache: [B, Hkv, L, D], dtype of ``query``, identical shapes.
        cache_position: [S] int32/int64, the cache row each token's K/V goes to (same for every
            batch element). Rows outside ``[0, L)`` are skipped: -1 is the usual padding marker.
            If two tokens name the same row, each element of that row ends up holding the value
            of one of them, unspecified which (tokens may mix within the row, as with
            ``index_copy_`` on CUDA); every other row is untouched.
        q_norm_weight, k_norm_weight: [D], dtype of ``query``.
        inv_freq: [D/2] float32 rotary inverse frequencies.
        rms_norm_eps: RMSNorm epsilon (Python float).
        inplace: True (default) writes the S rows into ``key_cache``/``value_cache`` and returns
            those same tensors: one launch, no cache copy. False leaves them untouched and returns
            fresh copies with the rows written (costs a full copy of both caches).
        query_out, key_out: optional preallocated outputs ([B, Hq, S, D] / [B, Hkv, S, D], dtype
            of ``query``, any strides) for allocation-free calls (CUDA graphs). ``query_out`` may
            be ``query`` itself (and ``key_out`` ``key``); no other overlap is allowed.
        validate: also raise ``ValueError`` when ``cache_position`` leaves ``[0, L)`` (costs a
            host sync, so it is off by default and such rows are skipped silently).
        norm_rounding: ``"weight_fp32"`` (default; SPEC §1 and the public benchmark): the weight
            multiply happens in fp32 before the one rounding of the normalized row. ``"hf"``:
            as HF transformers' ``Qwen3RMSNorm``, the normalized row is rounded first and then
            multiplied by the weight in the activation dtype (a second rounding).

    Returns:
        ``(query_rotated, key_rotated, key_cache_out, value_cache_out)``.
    """
    if torch.compiler.is_compiling():  # traced: go through the registered custom op
        from .registration import traced_call

        return traced_call(query, key, value, position_ids, key_cache, value_cache,
                           cache_position, q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
                           inplace=inplace, query_out=query_out, key_out=key_out,
                           validate=validate, norm_rounding=norm_rounding)
    if validate or not inplace:  # both cost far more than the checks: check first
        check_inputs(query, key, value, position_ids, key_cache, value_cache, cache_position,
                     q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps)
        if validate:
            _check_cache_position_range(cache_position, key_cache.shape[2])
        if not inplace:
            key_cache, value_cache = key_cache.clone(), value_cache.clone()
    tensors = [query, key, value, position_ids, key_cache, value_cache, cache_position,
               q_norm_weight, k_norm_weight, inv_freq]
    hf_norm = norm_rounding == "hf"
    if not hf_norm and norm_rounding != "weight_fp32":
        raise ValueError(f"norm_rounding must be one of {NORM_ROUNDINGS}, got {norm_rounding!r}")
    addresses = []
    plan = (_PLANS.find(signature(hf_norm, (*tensors, query_out, key_out), addresses))
            if fast_path_ok() else None)
    if plan is None or type(rms_norm_eps) is not float or not 0.0 <= rms_norm_eps < math.inf:
        return _checked_call(tensors, rms_norm_eps, query_out, key_out, hf_norm)
    query_out, key_out, *addresses[10:] = outputs(query, key, query_out, key_out)
    plan.launch(addresses, rms_norm_eps)
    return query_out, key_out, key_cache, value_cache


# --------------------------------------------------------------------------------------------
# launching
# --------------------------------------------------------------------------------------------
def _kernel_args(query, key, value, position_ids, key_cache, value_cache, cache_position,
                 q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out,
                 cfg: TileConfig, hf_norm: bool = False) -> tuple[tuple[int, int, int], list, dict]:
    """``(grid, positional args, constexpr kwargs)`` for one launch; the only place that maps
    tensors and strides onto the kernel's parameters."""
    B, Hq, S, D = query.shape
    Hkv, L = key.shape[1], key_cache.shape[2]
    grid = (triton.cdiv(S, cfg.block_s),
            triton.cdiv(Hq, cfg.block_hq) + triton.cdiv(Hkv, cfg.block_hkv), B)
    # [1, S] positions broadcast over the batch through a zero batch stride.
    pos_stride_b = position_ids.stride(0) if position_ids.shape[0] == B else 0
    args = [
        query, key, value, position_ids, key_cache, value_cache, cache_position,
        q_norm_weight, k_norm_weight, inv_freq, query_out, key_out,
        float(rms_norm_eps), S, Hq, Hkv, L,
        *query.stride(), *key.stride(), *value.stride(),
        *query_out.stride(), *key_out.stride(),
        *key_cache.stride(), *value_cache.stride(),
        pos_stride_b, position_ids.stride(1), cache_position.stride(0),
        q_norm_weight.stride(0), k_norm_weight.stride(0), inv_freq.stride(0),
    ]
    interpret = interpreting()
    meta = dict(HALF=D // 2, BLOCK_HQ=cfg.block_hq, BLOCK_HKV=cfg.block_hkv,
                BLOCK_S=cfg.block_s, INTERPRETER=interpret,
                EVICTION=cfg.eviction, TRIG=cfg.trig,
                HF_NORM=hf_norm,
                # The rounding points forbid contracting a product and a sum into one FMA.
                enable_fp_fusion=False, num_warps=cfg.num_warps)
    return grid, args, meta


def launch(query, key, value, position_ids, key_cache, value_cache, cache_position,
           q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out,
           cfg: TileConfig, hf_norm: bool = False):
    """Launch through Triton's normal path on already-checked arguments; returns
    ``(grid, args, meta, compiled kernel)`` (the kernel is None in the interpreter)."""
    grid, args, meta = _kernel_args(query, key, value, position_ids, key_cache, value_cache,
                                    cache_position, q_norm_weight, k_norm_weight, inv_freq,
                                    rms_norm_eps, query_out, key_out, cfg, hf_norm)
    with device_of(query):  # Triton launches on the current device
        compiled = qknorm_rope_cache_kernel[grid](*args, **meta)
    return grid, args, meta, compiled


_PLANS = PlanCache()


def _checked_call(tensors, rms_norm_eps, query_out, key_out, hf_norm: bool):
    """The full path: check every argument, allocate outputs, launch through Triton, and
    remember the compiled kernel for this signature."""
    (query, key, value, position_ids, key_cache, value_cache, cache_position,
     q_norm_weight, k_norm_weight, inv_freq) = tensors
    B, Hq, Hkv, S, D, L = check_inputs(*tensors, rms_norm_eps)
    key_of_call = signature(hf_norm, (*tensors, query_out, key_out), [])
    query_out, key_out = outputs_like(query, key, query_out, key_out)
    cfg = pick_config(B, Hq, Hkv, S, D, interpreting())
    grid, args, meta, compiled = launch(*tensors, rms_norm_eps, query_out, key_out, cfg, hf_norm)
    # Per call: the ten input tensors, both outputs and rms_norm_eps; the rest is fixed.
    _PLANS.remember(key_of_call, qknorm_rope_cache_kernel, compiled, grid, args, meta, 13,
                    query.get_device())
    return query_out, key_out, key_cache, value_cache
