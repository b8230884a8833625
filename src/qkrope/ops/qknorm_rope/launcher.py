"""Host side of the op: one common checker, two thin layout adapters, one tile picker and one
launch, shared by both public entry points (``api.py``)."""

from __future__ import annotations

import functools
import math
import numbers
import struct
from typing import NamedTuple

import torch
import triton

from ..._interpret import interpreting
from .._launch import KernelLauncher
from .._overlap import check_disjoint, extent
from .kernel import qknorm_rope_kernel

__all__ = ["Options", "TileConfig", "HEAD_DIMS", "check_bhsd", "check_paged", "pick_config",
           "launch", "LAUNCHER", "scale_tensor", "wide_offsets"]

HEAD_DIMS = (64, 128, 256, 512)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
INDEX_DTYPES = (torch.int32, torch.int64)
NORM_ROUNDINGS = ("weight_fp32", "hf")
ROTARY_STYLES = ("neox", "gptj")
LAYOUTS = ("bhsd", "NHD", "HND")

#: The kernel parameters that change from call to call, in the order the fast path passes them
#: (``KernelLauncher.fast_call``): the input tensors' addresses, the outputs', then eps.
PER_CALL = ("q_ptr", "k_ptr", "v_ptr", "pos_ptr", "k_cache_ptr", "v_cache_ptr", "slot_ptr",
            "q_w_ptr", "k_w_ptr", "inv_freq_ptr", "k_scale_ptr", "v_scale_ptr",
            "q_out_ptr", "k_out_ptr", "eps")
LAUNCHER = KernelLauncher(qknorm_rope_kernel, PER_CALL,
                          written=("k_cache_ptr", "v_cache_ptr", "q_out_ptr", "k_out_ptr"),
                          in_place=(("q_out_ptr", "q_ptr"), ("k_out_ptr", "k_ptr")))


class Options(NamedTuple):
    """The static options of a call (hashable: part of the fast path's signature)."""

    layout: str = "bhsd"                 # "bhsd", or the paged cache layout "NHD" / "HND"
    rotary_style: str = "neox"
    rotary_dim: int | None = None        # None: head_dim
    norm_weight_offset: float = 0.0
    norm_rounding: str = "weight_fp32"
    cos_sin_scale: float = 1.0
    mrope_section: tuple | None = None
    mrope_interleaved: bool = False


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor(name: str, x, rank: int | tuple[int, ...], dtypes) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if hasattr(x, "to_local"):  # a DTensor: the kernel addresses one device's memory
        raise TypeError(f"{name} is a {type(x).__name__}; pass this rank's tensor "
                        f"({name}.to_local())")
    ranks = (rank,) if isinstance(rank, int) else rank
    if x.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {want}, got shape {list(x.shape)}")
    if x.dtype not in dtypes:
        want = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {_dtype_name(x.dtype)}")
    return x


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {list(expected)} ({what}), got {list(x.shape)}")


def _real(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(x).__name__}")
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


#: float32's largest finite and smallest normal magnitudes.
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 2.0**-126


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (nearest even), +-inf beyond float32's range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _fp32(name: str, x: float) -> float:
    """A scalar the kernel uses as float32: refused where its float32 rounding is infinite, or
    0 or subnormal for a nonzero ``x`` (the op would compute with another value than asked:
    all-NaN or all-zero outputs, or subnormals, which GPU math may flush to zero)."""
    y = _as_float32(x)
    if math.isinf(y):
        raise ValueError(f"{name} must be within float32's range (|{name}| <= {FP32_MAX:.8g}; "
                         f"the kernel computes in float32, where {x} is {y}), got {x}")
    if x != 0 and abs(y) < FP32_TINY:
        raise ValueError(f"{name} must be 0 or at least float32's smallest normal value "
                         f"({FP32_TINY:.8g}) in magnitude (the kernel computes in float32, where "
                         f"{x} is {'0' if y == 0 else 'subnormal'}), got {x}")
    return x


def _type_name(x) -> str:
    """``x``'s type as a caller would spell it: ``float``, ``numpy.bool``."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_options(opts: Options, D: int) -> Options:
    """Validated options with ``rotary_dim`` and ``mrope_section`` in canonical form."""
    if opts.rotary_style not in ROTARY_STYLES:
        raise ValueError(f"rotary_style must be one of {ROTARY_STYLES}, got {opts.rotary_style!r}")
    if opts.norm_rounding not in NORM_ROUNDINGS:
        raise ValueError(f"norm_rounding must be one of {NORM_ROUNDINGS}, got "
                         f"{opts.norm_rounding!r}")
    offset = _fp32("norm_weight_offset", _real("norm_weight_offset", opts.norm_weight_offset))
    if offset and opts.norm_rounding == "hf":
        raise ValueError("norm_weight_offset (Gemma-style 1 + w) needs norm_rounding="
                         "'weight_fp32', the rounding of the models that use it")
    scale = _real("cos_sin_scale", opts.cos_sin_scale)
    if scale <= 0:
        raise ValueError(f"cos_sin_scale must be > 0, got {scale}")
    _fp32("cos_sin_scale", scale)
    rot = D if opts.rotary_dim is None else opts.rotary_dim
    if isinstance(rot, bool) or not isinstance(rot, int) or not (2 <= rot <= D and rot % 2 == 0):
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim={D}], got "
                         f"{opts.rotary_dim!r}")
    section = opts.mrope_section
    if section is not None:
        try:
            section = tuple(int(s) for s in section)
            ok = len(section) == 3 and all(s >= 0 for s in section) and all(
                type(s) is not bool and int(s) == s for s in opts.mrope_section)
        except (TypeError, ValueError):
            ok = False
        if not ok or sum(section) != rot // 2:
            raise ValueError(f"mrope_section must be 3 non-negative ints (temporal, height, "
                             f"width) summing to rotary_dim/2={rot // 2}, got "
                             f"{opts.mrope_section!r}")
    if not isinstance(opts.mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved must be a Python bool (True or False), got "
                        f"{opts.mrope_interleaved!r} of type {_type_name(opts.mrope_interleaved)}")
    if opts.mrope_interleaved and section is None:
        raise ValueError("mrope_interleaved=True needs mrope_section (the temporal, height and "
                         "width frequency counts it interleaves); without it the op would run "
                         "plain RoPE")
    return opts._replace(rotary_dim=rot, norm_weight_offset=offset, cos_sin_scale=scale,
                         mrope_section=section)


def scale_tensor(name: str, scale, cache: torch.Tensor, num_kv_heads: int):
    """An FP8 cache's scale as a float32 device tensor of 1 or Hkv elements (Python floats are
    cached per value and device), None for a cache of the activation dtype."""
    if cache.dtype not in FP8_CACHE_DTYPES:
        if scale is not None:
            raise ValueError(f"{name} is only used with a float8_e4m3fn cache, got a "
                             f"{_dtype_name(cache.dtype)} cache")
        return None
    if scale is None:
        raise ValueError(f"{name} is required for a float8_e4m3fn cache (stored = "
                         f"saturate(x / {name}))")
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be finite and > 0, got {scale}")
        _fp32(name, float(scale))  # stored as a float32 tensor
        if torch.compiler.is_compiling():  # traced: a graph constant, not a cached tensor
            return torch.full((1,), float(scale), dtype=torch.float32, device=cache.device)
        return _scalar_on(float(scale), cache.device)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a Python float or a float32 tensor")
    if scale.dim() > 1 or scale.numel() not in (1, num_kv_heads) or scale.device != cache.device:
        raise ValueError(f"{name} must be a 0-d or 1-d tensor of 1 or Hkv={num_kv_heads} "
                         f"elements on {cache.device}, got shape {list(scale.shape)} on "
                         f"{scale.device}")
    return scale


@functools.lru_cache(maxsize=64)
def _scalar_on(value: float, device: torch.device) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _check_common(query, key, value, key_cache, value_cache, q_norm_weight, k_norm_weight,
                  inv_freq, rms_norm_eps, opts: Options, Hq: int, Hkv: int, D: int,
                  others: dict) -> Options:
    """What both layouts check alike; ``others``: the layout's remaining tensors by name
    (positions, cache rows), checked for device here."""
    act = query.dtype
    for name, x in (("key", key), ("value", value)):
        _tensor(name, x, query.dim(), (act,))
    _tensor("q_norm_weight", q_norm_weight, 1, (act,))
    _tensor("k_norm_weight", k_norm_weight, 1, (act,))
    _tensor("inv_freq", inv_freq, 1, (torch.float32,))
    eps = _real("rms_norm_eps", rms_norm_eps)
    if eps < 0:
        raise ValueError(f"rms_norm_eps must be >= 0, got {rms_norm_eps}")
    _fp32("rms_norm_eps", eps)  # passed to the kernel as float32
    if D not in HEAD_DIMS:
        raise ValueError(f"query head_dim must be one of {HEAD_DIMS}, got {D}")
    if Hq < 1 or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key heads ({Hkv})")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache must be {_dtype_name(key_cache.dtype)} like key_cache, got "
                        f"{_dtype_name(value_cache.dtype)}")
    opts = _check_options(opts, D)
    _shape("q_norm_weight", q_norm_weight, (D,), "[D]")
    _shape("k_norm_weight", k_norm_weight, (D,), "[D]")
    _shape("inv_freq", inv_freq, (opts.rotary_dim // 2,), "[rotary_dim/2]")
    device = query.device
    for name, x in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("q_norm_weight", q_norm_weight),
                    ("k_norm_weight", k_norm_weight), ("inv_freq", inv_freq), *others.items()):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device} but query is on {device}: all inputs must "
                             "be on one device")
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        hint = ("; use qkrope.reference on CPU, or set TRITON_INTERPRET=1 before importing "
                "qkrope to run the kernel in Triton's interpreter" if device.type == "cpu"
                else "")
        raise ValueError(f"the fused kernel needs CUDA tensors (CPU tensors in Triton's "
                         f"interpreter), got query on {device}{hint}")
    return opts


def _positions(name: str, positions, tokens: tuple[int, ...], opts: Options, what: str) -> None:
    """positions: ``tokens`` shape, or [3, *tokens] with mRoPE (a leading 1 broadcasts)."""
    _tensor(name, positions, len(tokens) + (opts.mrope_section is not None), INDEX_DTYPES)
    shape = tuple(positions.shape)
    if opts.mrope_section is not None:
        if shape[0] != 3:
            raise ValueError(f"{name} must have shape [3, {what}] with mrope_section (temporal, "
                             f"height, width streams), got {list(shape)}")
        shape = shape[1:]
        what = f"[3, {what}]"
    ok = len(shape) == len(tokens) and shape[-1] == tokens[-1] and all(
        s in (1, t) for s, t in zip(shape[:-1], tokens[:-1]))
    if not ok:
        raise ValueError(f"{name} must have shape {what}, got {list(positions.shape)}")


def _cache_dtypes(act: torch.dtype) -> tuple:
    return (act, *FP8_CACHE_DTYPES)


def check_bhsd(query, key, value, position_ids, key_cache, value_cache, cache_position,
               q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, opts: Options) -> Options:
    """Checks of the [B, H, S, D] entry point; raises TypeError/ValueError naming the
    argument; returns the canonical options."""
    _tensor("query", query, 4, ACTIVATION_DTYPES)
    _tensor("key_cache", key_cache, 4, _cache_dtypes(query.dtype))
    _tensor("value_cache", value_cache, 4, _cache_dtypes(query.dtype))
    _tensor("cache_position", cache_position, 1, INDEX_DTYPES)
    B, Hq, S, D = query.shape
    if B > 65535:  # the batch is the launch grid's z dimension
        raise ValueError(f"query batch must be <= 65535, got {B}; split the batch or use "
                         "qkrope.fused_qk_norm_rope_paged (token-major)")
    Hkv = key.shape[1] if isinstance(key, torch.Tensor) and key.dim() == 4 else 1
    opts = _check_common(query, key, value, key_cache, value_cache, q_norm_weight,
                         k_norm_weight, inv_freq, rms_norm_eps, opts, Hq, Hkv, D,
                         {"position_ids": position_ids, "cache_position": cache_position})
    if B < 1 or S < 1:
        raise ValueError(f"query must be non-empty, got {list(query.shape)}")
    _shape("key", key, (B, Hkv, S, D), "[B, Hkv, S, D] matching query's B, S, D")
    _shape("value", value, (B, Hkv, S, D), "[B, Hkv, S, D] like key")
    L = key_cache.shape[2]
    _shape("key_cache", key_cache, (B, Hkv, L, D), "[B, Hkv, L, D] matching key's B, Hkv, D")
    _shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    _positions("position_ids", position_ids, (B, S), opts, f"[{B}, {S}] or [1, {S}] ([B, S])")
    _shape("cache_position", cache_position, (S,), "[S]")
    return opts


def check_paged(query, key, value, positions, key_cache, value_cache, slot_mapping,
                q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, opts: Options) -> Options:
    """Checks of the token-major / paged entry point (as :func:`check_bhsd`)."""
    _tensor("query", query, 3, ACTIVATION_DTYPES)
    _tensor("key_cache", key_cache, 4, _cache_dtypes(query.dtype))
    _tensor("value_cache", value_cache, 4, _cache_dtypes(query.dtype))
    _tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    if opts.layout not in ("NHD", "HND"):
        raise ValueError(f"cache_layout must be one of ('NHD', 'HND'), got {opts.layout!r}")
    T, Hq, D = query.shape
    Hkv = key.shape[1] if isinstance(key, torch.Tensor) and key.dim() == 3 else 1
    opts = _check_common(query, key, value, key_cache, value_cache, q_norm_weight,
                         k_norm_weight, inv_freq, rms_norm_eps, opts, Hq, Hkv, D,
                         {"positions": positions, "slot_mapping": slot_mapping})
    if T < 1:
        raise ValueError(f"query must hold T >= 1 tokens, got {list(query.shape)}")
    _shape("key", key, (T, Hkv, D), "[T, Hkv, D] matching query's T and D")
    _shape("value", value, (T, Hkv, D), "[T, Hkv, D] like key")
    nb = key_cache.shape[0]
    if opts.layout == "NHD":
        _shape("key_cache", key_cache, (nb, key_cache.shape[1], Hkv, D),
               "NHD: [num_blocks, block_size, Hkv, D]")
    else:
        _shape("key_cache", key_cache, (nb, Hkv, key_cache.shape[2], D),
               "HND: [num_blocks, Hkv, block_size, D]")
    _shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    _positions("positions", positions, (T,), opts, f"[{T}]")
    _shape("slot_mapping", slot_mapping, (T,), "[T]")
    return opts


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


@functools.lru_cache(maxsize=1024)
def pick_config(B: int, T: int, Hq: int, Hkv: int, D: int, interpret: bool) -> TileConfig:
    """Tile shape for ``B`` x ``T`` tokens; cached per shape so the hot path does no search."""
    if interpret:
        # ~5 ms per program instance in the interpreter: few programs, whole head groups.
        return TileConfig(triton.next_power_of_2(Hq), triton.next_power_of_2(Hkv),
                          min(triton.next_power_of_2(T), 32), 4)
    block_hq = min(triton.next_power_of_2(Hq), max(1, 2048 // D))
    block_hkv = min(triton.next_power_of_2(Hkv), max(1, 1024 // D))
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
           k_norm_weight, inv_freq, k_scale, v_scale, query_out, key_out, rms_norm_eps,
           opts: Options):
    """Launch the kernel on checked arguments (``opts`` canonical, scales as device tensors or
    None); returns ``(compiled kernel or None, grid, args, meta)``. Refuses (``ValueError``)
    outputs or caches that share memory with anything else of the call."""
    bhsd = opts.layout == "bhsd"
    check_disjoint(
        dict(query_out=query_out, key_out=key_out, key_cache=key_cache, value_cache=value_cache),
        {"query": query, "key": key, "value": value,
         "position_ids" if bhsd else "positions": positions,
         "cache_position" if bhsd else "slot_mapping": slots, "q_norm_weight": q_norm_weight,
         "k_norm_weight": k_norm_weight, "inv_freq": inv_freq, "k_scale": k_scale,
         "v_scale": v_scale},
        identical_ok=(("query_out", "query"), ("key_out", "key")))
    if bhsd:
        args, (B, T), bhtd = _bhsd_args(query, key_cache, value_cache, positions)
    else:
        args, (B, T), bhtd = _paged_args(opts.layout, key_cache, value_cache, positions)
    Hq, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]  # [B, H, S, D] or [T, H, D]
    cfg = pick_config(B, T, Hq, Hkv, D, interpreting())
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
        eps=float(rms_norm_eps), Hq=Hq, Hkv=Hkv, stride_slot=slots.stride(0),
        stride_q_w=q_norm_weight.stride(0), stride_k_w=k_norm_weight.stride(0),
        stride_inv_freq=inv_freq.stride(0),
        # A per-tensor scale is read by every head through a zero stride.
        stride_k_scale=_scale_stride(k_scale), stride_v_scale=_scale_stride(v_scale),
    )
    section = opts.mrope_section or (0, 0, 0)
    meta = dict(
        D=D, ROT=opts.rotary_dim or D, GPTJ=opts.rotary_style == "gptj",
        HF_NORM=opts.norm_rounding == "hf", W_OFFSET=float(opts.norm_weight_offset),
        COS_SIN_SCALE=float(opts.cos_sin_scale),
        MROPE=0 if opts.mrope_section is None else (2 if opts.mrope_interleaved else 1),
        SEC_T=section[0], SEC_H=section[1], SEC_W=section[2], PAGED=opts.layout != "bhsd",
        K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
        BLOCK_HQ=cfg.block_hq, BLOCK_HKV=cfg.block_hkv, BLOCK_T=cfg.block_t,
        INTERPRETER=interpreting(),
        WIDE=wide_offsets(query, key, value, positions, key_cache, value_cache, slots,
                          q_norm_weight, k_norm_weight, inv_freq, k_scale, v_scale, query_out,
                          key_out),
        # The rounding points forbid contracting a product and a sum into one FMA.
        enable_fp_fusion=False, num_warps=cfg.num_warps)
    compiled = LAUNCHER.launch(grid, args, meta, query.device)
    return compiled, grid, args, meta


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


def _scale_stride(scale) -> int:
    return 0 if scale is None or scale.numel() == 1 else scale.stride(-1)
