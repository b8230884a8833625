"""Argument checks of both entry points: types, dtypes, ranks, shapes, devices, the scalar
options' float32 ranges, option canonicalisation, the outputs, autograd and memory overlap.

Each check raises ``TypeError`` / ``ValueError`` naming the argument the caller passed and what
was expected, before anything is written. The public functions (``api.py``) call these; the
registered op's body calls :func:`check_overlap` before a checked launch (the fast path runs the
same overlap rules natively); ``launcher.py`` checks nothing.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple

import torch

from ..._interpret import interpreting
from .. import _native
from .._overlap import check_disjoint

__all__ = ["HEAD_DIMS", "ACTIVATION_DTYPES", "FP8_CACHE_DTYPES", "INDEX_DTYPES", "FP32_MAX",
           "FP32_TINY", "Options", "dtype_name", "tensor_arg", "scale_tensor", "scale_cache",
           "scalar_on",
           "check_bhsd", "check_paged", "check_cos_sin", "TABLE_DTYPES", "kernel_device",
           "check_out", "head_count", "refuse_autograd",
           "check_overlap"]

HEAD_DIMS = (64, 128, 256, 512)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8 = "float8_e4m3fn or float8_e5m2"
#: Cache dtypes of the per-token-head mode (k_scale_cache / v_scale_cache): vLLM's
#: fp8_per_token_head and int8_per_token_head.
TOKEN_HEAD_DTYPES = (torch.float8_e4m3fn, torch.int8)
INDEX_DTYPES = (torch.int32, torch.int64)
#: inv_freq as a model keeps it (model.to(bf16) casts the buffer); the kernel reads it as
#: float32, which every bf16 / fp16 value is exactly.
INV_FREQ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORM_ROUNDINGS = ("weight_fp32", "hf")
ROTARY_STYLES = ("neox", "gptj")
LAYOUTS = ("bhsd", "NHD", "HND")


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
    # bhsd only: the rows are a running length (cache_position, one int64), advanced by S
    append: bool = False


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: Tensor types that are never a DTensor: no ``to_local`` lookup for them (under torch.compile
#: each lookup is a guard that the compiled step evaluates on every call).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def tensor_arg(name: str, x, rank: int | tuple[int, ...], dtypes) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    # A DTensor: the kernel addresses one device's memory.
    if type(x) not in PLAIN_TENSORS and hasattr(x, "to_local"):
        raise TypeError(f"{name} is a {type(x).__name__}; pass this rank's tensor "
                        f"({name}.to_local())")
    _refuse_negative_view(name, x)
    ranks = (rank,) if isinstance(rank, int) else rank
    if x.dim() not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {want}, got shape {list(x.shape)}")
    if x.dtype not in dtypes:
        want = " or ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {dtype_name(x.dtype)}")
    return x


def _refuse_negative_view(name: str, x: torch.Tensor) -> None:
    """A view with torch's negative bit (``torch._neg_view``, the imaginary part of a conjugate
    complex32 tensor) reads as the negation of the memory the kernel addresses: its values, or
    what a caller reads back from an output, would be negated, silently. (Not while
    torch.compile traces: Dynamo cannot trace ``is_neg``, and the graph's inputs reach the op
    resolved.)"""
    if not torch.compiler.is_compiling() and x.is_neg():
        raise ValueError(f"{name} is a negative-bit view (its memory holds the negated values); "
                         f"pass {name}.resolve_neg()")


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    # Size by size: under torch.compile, Dynamo compares two tuples of sizes as constants,
    # which would pin every symbolic size (a recompile per prefill length).
    if x.dim() != len(expected) or any(a != b for a, b in zip(x.shape, expected)):
        raise ValueError(f"{name} must have shape {list(expected)} ({what}), got {list(x.shape)}")


def static_scalar(x):
    """``x``, a constant of the graph where torch.compile traces it. A Python int or float
    argument of a compiled function may be traced as a symbol (``dynamic=True``, or once its
    value changed between calls), which the checks cannot judge and the options string cannot
    hold; the op's scalar options are part of its specialisation anyway (the plan, the checks),
    so they are made constants, a guard on their value (docs/design.md, "Compile route")."""
    if torch.compiler.is_compiling():
        # The forms Dynamo specialises a symbol by (int() and float() keep it symbolic).
        if type(x) is float:
            return x.__float__()
        if type(x) is int:
            return operator.index(x)
    return x


def _real(name: str, x) -> float:
    x = static_scalar(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(x).__name__}")
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}")
    return float(x)


#: float32's largest finite and smallest normal magnitudes.
FP32_MAX = 3.4028234663852886e38
FP32_TINY = 2.0**-126


def _as_float32(x: float) -> float:
    """``x`` rounded to float32 (nearest even; subnormals as float32 has them), +-inf beyond
    float32's range. Plain arithmetic, not ``struct``: the checks run while torch.compile
    traces the public function, and Dynamo's ``struct.pack`` recurses without end under
    ``dynamic=True`` (torch 2.13)."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    if e > 128:  # |x| >= 2**128
        return math.copysign(math.inf, x)
    bits = min(24, e + 149)  # float32's significand: 24 bits, fewer below 2**-126
    # |m| * 2**bits is exact; round() is half to even; ldexp exact, or 0 below 2**-149
    y = math.ldexp(round(math.ldexp(abs(m), bits)), e - bits)
    return math.copysign(math.inf if y > FP32_MAX else y, x)


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


def check_options(opts: Options, D: int) -> Options:
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
    rot = static_scalar(D if opts.rotary_dim is None else opts.rotary_dim)
    if isinstance(rot, bool) or not isinstance(rot, int) or not (2 <= rot <= D and rot % 2 == 0):
        raise ValueError(f"rotary_dim must be an even int in [2, head_dim={D}], got "
                         f"{opts.rotary_dim!r}")
    section = opts.mrope_section
    if section is not None:
        try:
            given = tuple(static_scalar(s) for s in section)
            section = tuple(int(s) for s in given)
            ok = len(section) == 3 and all(s >= 0 for s in section) and all(
                type(s) is not bool and int(s) == s for s in given)
        except (TypeError, ValueError):
            ok = False
        if not ok or sum(section) != rot // 2:
            raise ValueError(f"mrope_section must be 3 non-negative ints (temporal, height, "
                             f"width) summing to rotary_dim/2={rot // 2}, got "
                             f"{opts.mrope_section!r}")
    if not isinstance(opts.mrope_interleaved, bool):
        raise TypeError(f"mrope_interleaved must be a Python bool (True or False), got "
                        f"{opts.mrope_interleaved!r} of type {_type_name(opts.mrope_interleaved)}")
    _append_flag(opts.append)
    if opts.append and opts.layout != "bhsd":
        raise ValueError("append=True is a mode of the [B, H, S, D] entry point (a running "
                         "length per cache); paged caches take a slot per token")
    if opts.mrope_interleaved and section is None:
        raise ValueError("mrope_interleaved=True needs mrope_section (the temporal, height and "
                         "width frequency counts it interleaves); without it the op would run "
                         "plain RoPE")
    return opts._replace(rotary_dim=rot, norm_weight_offset=offset, cos_sin_scale=scale,
                         mrope_section=section)


def _append_flag(append) -> bool:
    if not isinstance(append, bool):
        raise TypeError(f"append must be a Python bool (True or False), got {append!r} of "
                        f"type {_type_name(append)}")
    return append


def scale_tensor(name: str, scale, users: dict, heads: int, heads_name: str):
    """The FP8 scale ``name`` of the tensors ``users`` (name -> tensor or None: a cache, an
    output) as a float32 device tensor of 1 or ``heads`` elements (Python floats are cached per
    value and device); None where none of them is FP8, which must then come without it."""
    given = {n: t for n, t in users.items() if t is not None}
    if not given:  # its only user takes per-token-head scales
        if scale is not None:
            raise ValueError(f"{name} is not used: {' and '.join(users)} takes per-token-head "
                             f"scales ({name}_cache)")
        return None
    fp8 = [n for n, t in given.items() if t.dtype in FP8_CACHE_DTYPES]
    device = next(iter(given.values())).device
    if not fp8:
        if scale is not None:
            got = ", ".join(f"{n} {dtype_name(t.dtype)}" for n, t in given.items())
            dynamic = [n for n, t in users.items() if t is None]
            here = (f" here ({' and '.join(dynamic)} takes per-token-head scales)"
                    if dynamic else "")
            raise ValueError(f"{name} is only used with a {_FP8} "
                             f"{' or '.join(given)}{here}, got {got}")
        return None
    if scale is None:
        raise ValueError(f"{name} is required for a {_FP8} {' and '.join(fp8)} (stored "
                         f"= saturate(x / {name}))")
    scale = static_scalar(scale)
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be finite and > 0, got {scale}")
        _fp32(name, float(scale))  # stored as a float32 tensor
        if torch.compiler.is_compiling():  # traced: a graph constant, not a cached tensor
            return torch.full((1,), float(scale), dtype=torch.float32, device=device)
        return scalar_on(float(scale), device)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a Python float or a float32 tensor")
    _refuse_negative_view(name, scale)
    if scale.dim() > 1 or (scale.numel() != 1 and scale.numel() != heads) or \
            scale.device != device:
        raise ValueError(f"{name} must be a 0-d or 1-d tensor of 1 or {heads_name}={heads} "
                         f"elements on {device}, got shape {list(scale.shape)} on "
                         f"{scale.device}")
    return scale


def scale_cache(name: str, cache_scales, cache_name: str, cache: torch.Tensor):
    """A per-token-head scale cache (written by the op: each written row's float32 scale):
    the shape of ``cache`` without its head_dim, ``cache`` in float8_e4m3fn or int8; or None
    (an int8 ``cache`` needs one: it has no other scale)."""
    if cache_scales is None:
        if cache.dtype == torch.int8:
            raise ValueError(f"an int8 {cache_name} takes per-token-head scales: pass {name}")
        return None
    tensor_arg(name, cache_scales, cache.dim() - 1, (torch.float32,))
    if cache.dtype not in TOKEN_HEAD_DTYPES:
        raise ValueError(f"{name} holds the per-token-head scales of a float8_e4m3fn or int8 "
                         f"{cache_name}, got a {dtype_name(cache.dtype)} {cache_name}")
    _shape(name, cache_scales, tuple(cache.shape[:-1]), f"{cache_name}'s shape without D")
    if cache_scales.device != cache.device:
        raise ValueError(f"{name} is on {cache_scales.device} but {cache_name} is on "
                         f"{cache.device}")
    return cache_scales


def check_scales(query, key, key_cache, value_cache, query_out, key_out, scales: tuple,
                 scale_caches: tuple) -> tuple[tuple, tuple]:
    """The FP8 scales of a call: the caller's ``(k_scale, v_scale, q_scale)`` as
    :func:`scale_tensor` gives them and its ``(k_scale_cache, v_scale_cache)`` checked, for
    outputs and caches already checked. A cache with per-token-head scales takes no static
    scale (``k_scale`` may still serve an FP8 ``key_out``)."""
    Hq, Hkv = query.shape[1], key.shape[1]
    k_cache_scales = scale_cache("k_scale_cache", scale_caches[0], "key_cache", key_cache)
    v_cache_scales = scale_cache("v_scale_cache", scale_caches[1], "value_cache", value_cache)
    k_scale, v_scale, q_scale = scales
    return (scale_tensor("k_scale", k_scale,
                         {"key_cache": None if k_cache_scales is not None else key_cache,
                          "key_out": key_out}, Hkv, "Hkv"),
            scale_tensor("v_scale", v_scale,
                         {"value_cache": None if v_cache_scales is not None else value_cache},
                         Hkv, "Hkv"),
            scale_tensor("q_scale", q_scale, {"query_out": query_out}, Hq, "Hq")), \
        (k_cache_scales, v_cache_scales)


_SCALARS: dict = {}
_SCALARS_MAX = 256


def scalar_on(value: float, device: torch.device) -> torch.Tensor:
    """``value`` as a float32 [1] tensor on ``device``, kept per value and device (a Python
    float scale costs no allocation per call). Never evicted: a CUDA graph that captured one
    reads it at every replay. One made during a capture is the capture's own (filled at every
    replay), as is one made under a tracing mode (a fake tensor), and past the cache's size
    one is made per call: none of these is kept."""
    t = _SCALARS.get((value, device))
    if t is None:
        t = torch.full((1,), value, dtype=torch.float32, device=device)
        # (A fake or traced tensor, made under a tracing mode, is that trace's own: not kept.)
        if type(t) is torch.Tensor and len(_SCALARS) < _SCALARS_MAX and not (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _SCALARS[value, device] = t
            _native.keep_scalar(value, t)  # the fast path's signature takes the float itself
    return t


def _check_common(query, key, value, key_cache, value_cache, q_norm_weight, k_norm_weight,
                  inv_freq, rms_norm_eps, opts: Options, Hq: int, Hkv: int, D: int,
                  others: dict) -> Options:
    """What both layouts check alike; ``others``: the layout's remaining tensors by name
    (positions, cache rows), checked for device here."""
    act = query.dtype
    for name, x in (("key", key), ("value", value)):
        tensor_arg(name, x, query.dim(), (act,))
    tensor_arg("q_norm_weight", q_norm_weight, 1, (act,))
    tensor_arg("k_norm_weight", k_norm_weight, 1, (act,))
    tensor_arg("inv_freq", inv_freq, 1, INV_FREQ_DTYPES)
    eps = _real("rms_norm_eps", rms_norm_eps)
    if eps < 0:
        raise ValueError(f"rms_norm_eps must be >= 0, got {rms_norm_eps}")
    _fp32("rms_norm_eps", eps)  # passed to the kernel as float32
    if D not in HEAD_DIMS:
        raise ValueError(f"query head_dim must be one of {HEAD_DIMS}, got {D}")
    if Hq < 1 or Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a positive multiple of key heads ({Hkv})")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache must be {dtype_name(key_cache.dtype)} like key_cache, got "
                        f"{dtype_name(value_cache.dtype)}")
    opts = check_options(opts, D)
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
    kernel_device("query", device)
    return opts


def kernel_device(name: str, device: torch.device) -> None:
    """Refuse a device the kernels cannot run on: CUDA, or the CPU under Triton's interpreter."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        hint = ("; use qkrope.reference on CPU, or set TRITON_INTERPRET=1 before importing "
                "qkrope to run the kernel in Triton's interpreter" if device.type == "cpu"
                else "")
        raise ValueError(f"the fused kernel needs CUDA tensors (CPU tensors in Triton's "
                         f"interpreter), got {name} on {device}{hint}")


def _positions(name: str, positions, tokens: tuple[int, ...], opts: Options, what: str) -> None:
    """positions: ``tokens`` shape, or [3, *tokens] with mRoPE (a leading 1 broadcasts).
    ``what``: the expected shape as a template of ``tokens`` (``"[{0}, {1}]"``), formatted only
    for an error: under torch.compile formatting a symbolic size pins it."""
    tensor_arg(name, positions, len(tokens) + (opts.mrope_section is not None), INDEX_DTYPES)
    shape = tuple(positions.shape)
    if opts.mrope_section is not None:
        if shape[0] != 3:
            raise ValueError(f"{name} must have shape [3, {what.format(*tokens)}] with "
                             f"mrope_section (temporal, height, width streams), got "
                             f"{list(shape)}")
        shape = shape[1:]
        what = f"[3, {what}]"
    # (== each, not ``in (1, t)``: Dynamo's ``in`` on a tuple of sizes misjudges symbolic ones)
    ok = len(shape) == len(tokens) and shape[-1] == tokens[-1] and all(
        s == 1 or s == t for s, t in zip(shape[:-1], tokens[:-1]))
    if not ok:
        raise ValueError(f"{name} must have shape {what.format(*tokens)}, got "
                         f"{list(positions.shape)}")


def _cache_dtypes(act: torch.dtype) -> tuple:
    return (act, *FP8_CACHE_DTYPES, torch.int8)


def check_bhsd(query, key, value, position_ids, key_cache, value_cache, cache_position,
               q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, opts: Options) -> Options:
    """Checks of the [B, H, S, D] entry point; raises TypeError/ValueError naming the
    argument; returns the canonical options."""
    tensor_arg("query", query, 4, ACTIVATION_DTYPES)
    tensor_arg("key_cache", key_cache, 4, _cache_dtypes(query.dtype))
    tensor_arg("value_cache", value_cache, 4, _cache_dtypes(query.dtype))
    if _append_flag(opts.append):
        tensor_arg("cache_position", cache_position, (0, 1), (torch.int64,))
    else:
        tensor_arg("cache_position", cache_position, 1, INDEX_DTYPES)
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
    _positions("position_ids", position_ids, (B, S), opts, "[{0}, {1}] or [1, {1}] ([B, S])")
    if opts.append:
        if cache_position.numel() != 1:
            raise ValueError(f"cache_position must be one element with append=True (the cache's "
                             f"running length, [] or [1]), got shape {list(cache_position.shape)}")
        if S > L:
            raise ValueError(f"append=True: S={S} new rows do not fit key_cache's L={L} rows")
    else:
        _shape("cache_position", cache_position, (S,), "[S]")
    return opts


def check_paged(query, key, value, positions, key_cache, value_cache, slot_mapping,
                q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, opts: Options) -> Options:
    """Checks of the token-major / paged entry point (as :func:`check_bhsd`)."""
    tensor_arg("query", query, 3, ACTIVATION_DTYPES)
    tensor_arg("key_cache", key_cache, 4, _cache_dtypes(query.dtype))
    tensor_arg("value_cache", value_cache, 4, _cache_dtypes(query.dtype))
    tensor_arg("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
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
    _positions("positions", positions, (T,), opts, "[{0}]")
    _shape("slot_mapping", slot_mapping, (T,), "[T]")
    return opts


TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_cos_sin(position_ids, inv_freq, dtype, opts: Options) -> Options:
    """The rotary table's arguments (``api.rope_cos_sin``); ``opts`` carries its
    ``cos_sin_scale`` and mRoPE options. Returns them canonical."""
    tensor_arg("inv_freq", inv_freq, 1, INV_FREQ_DTYPES)
    half = inv_freq.shape[0]
    if half < 1:
        raise ValueError("inv_freq must hold at least one frequency, got shape [0]")
    opts = check_options(opts._replace(rotary_dim=2 * half), 2 * half)
    ranks = (2, 3) if opts.mrope_section is not None else 2
    tensor_arg("position_ids", position_ids, ranks, INDEX_DTYPES)
    if position_ids.dim() == 3 and position_ids.shape[0] != 3:
        raise ValueError(f"position_ids must have shape [B, S] or [3, B, S] (temporal, height, "
                         f"width streams), got {list(position_ids.shape)}")
    if dtype not in TABLE_DTYPES:
        raise TypeError(f"dtype must be one of {', '.join(map(dtype_name, TABLE_DTYPES))}, "
                        f"got {dtype!r}")
    device = position_ids.device
    if inv_freq.device != device:
        raise ValueError(f"inv_freq is on {inv_freq.device} but position_ids is on {device}: "
                         f"both must be on one device")
    kernel_device("position_ids", device)
    return opts


def check_out(name: str, out, like: torch.Tensor) -> None:
    """A caller's ``query_out`` / ``key_out``: a tensor of ``like``'s shape and device, of its
    dtype or FP8 (quantised output: its scale is checked with the scales)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    _refuse_negative_view(name, out)
    if tuple(out.shape) != tuple(like.shape):
        raise ValueError(f"{name} must have shape {list(like.shape)}, got {list(out.shape)}")
    if out.dtype != like.dtype and out.dtype not in FP8_CACHE_DTYPES:
        raise TypeError(f"{name} must be {dtype_name(like.dtype)}, float8_e4m3fn or "
                        f"float8_e5m2, got {dtype_name(out.dtype)}")
    if out.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {out.device}")


def head_count(name: str, n) -> int:
    """A positive int head count (``split_packed_qkv``'s arguments)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise TypeError(f"{name} must be a positive int, got {n!r}")
    return int(n)


#: The twelve tensors of a call in the kernel's order, as each entry point names them.
_NAMES = {"bhsd": ("query", "key", "value", "position_ids", "key_cache", "value_cache",
                   "cache_position", "q_norm_weight", "k_norm_weight", "inv_freq", "query_out",
                   "key_out"),
          "paged": ("query", "key", "value", "positions", "key_cache", "value_cache",
                    "slot_mapping", "q_norm_weight", "k_norm_weight", "inv_freq", "query_out",
                    "key_out")}


def refuse_autograd(layout: str, tensors: tuple, **others) -> None:
    """The op has no backward: refuse what autograd would record rather than return outputs
    cut off from the graph (wrong, silent gradients). ``tensors``: the twelve of
    :data:`_NAMES`; ``others``: the scales and scale caches by name (None where absent). Under
    torch.compile this runs at trace time, guarded on grad mode and ``requires_grad``."""
    if not torch.is_grad_enabled():
        return
    named = (*zip(_NAMES["bhsd" if layout == "bhsd" else "paged"], tensors), *others.items())
    for name, t in named:
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{name} requires grad, but qkrope's fused op has no backward (autograd): call "
                f"it under torch.no_grad() / torch.inference_mode(), or pass {name}.detach()")


def check_overlap(layout: str, tensors: tuple, k_scale, v_scale, q_scale=None,
                  k_scale_cache=None, v_scale_cache=None, append: bool = False) -> None:
    """Outputs and caches share memory with no other argument, nor with themselves
    (``ValueError`` naming both; docs/design.md, "Overlap rule"); ``tensors``: the twelve of
    :data:`_NAMES` in the kernel's order; with ``append`` the running length is written too.
    ``query_out`` may be ``query`` itself (and ``key_out`` ``key``). Runs on every checked
    launch, also inside a compiled graph (memory is known only when the call runs)."""
    names = _NAMES["bhsd" if layout == "bhsd" else "paged"]
    by_name = dict(zip(names, tensors))
    written = ("query_out", "key_out", "key_cache", "value_cache", *(
        ("cache_position",) if append else ()))
    check_disjoint({**{n: by_name[n] for n in written},
                    **{n: t for n, t in (("k_scale_cache", k_scale_cache),
                                         ("v_scale_cache", v_scale_cache)) if t is not None}},
                   {**{n: t for n, t in by_name.items() if n not in written},
                    "k_scale": k_scale, "v_scale": v_scale, "q_scale": q_scale},
                   identical_ok=(("query_out", "query"), ("key_out", "key")))
