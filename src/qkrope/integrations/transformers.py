"""HF transformers integration: the Qwen3 family's attention prologue through qkrope.

``patch(model)`` replaces, in every supported attention layer of ``model``, the q_norm + k_norm +
rotary (+ ``StaticCache`` write) sequence by one qkrope launch; ``unpatch(model)`` restores the
stock forwards (a patched model stays patched through ``copy.deepcopy`` and
``torch.save(model)`` / ``torch.load``). Supported attention classes (transformers 5.x; every
family tested bit for bit against the stock eager model on 5.24 through Triton's interpreter):

==========================================  ==================================================
family (attention class)                    what the op is told
==========================================  ==================================================
Qwen3, Qwen3-MoE                            NeoX rotary, ``norm_rounding="hf"``
Qwen3-VL, Qwen3-VL-MoE (text decoder)       + interleaved mRoPE over the 3 position streams
Qwen3.5, Qwen3.5-MoE (full-attention        gated ``[q | gate]`` query (a strided view, the gate
layers; linear-attention layers untouched)  stays here), ``(1 + w)`` fp32 norm, partial rotary,
                                            interleaved mRoPE
Qwen3-Next (full-attention layers)          gated query, ``(1 + w)`` fp32 norm, partial rotary
==========================================  ==================================================

Every rope type of the model's rotary embedding (default, YaRN, LongRoPE, dynamic, llama3, ...)
is honoured: ``inv_freq`` is read from the rotary module at every call (after its dynamic
update) and its ``attention_scaling`` becomes the op's ``cos_sin_scale``. The op's rounding
points are chosen per family to match the stock eager modeling code, so a patched model's
tokens and cache contents equal the stock eager model's bit for bit, up to the norm's fp32 sum
of squares, added in another order (one ulp where that flips a rounding).

Checks happen at patch time: a layer is patched only if the op can run it (head_dim in
{64, 128, 256, 512}, bf16/fp16 weights on a CUDA device or under Triton's interpreter, the
family's own RMSNorm on q and k with one epsilon, a rotary width the family allows, ...);
every other layer keeps its stock forward and ``patch`` warns once per reason
(:class:`FallbackWarning`). At call time a patched layer falls back to its stock forward, with
a one-time warning per reason, when it is training or autograd is recording (the op has no
backward; judged on its input, its parameters and, for modules set in after patch, the op's
own inputs), when its ``position_embeddings`` were not computed by the model's rotary embedding
in this forward, when a q/k norm's epsilon is no longer the one of patch time, or when the op
rejects the call; it never raises on the op's behalf. ``patch`` again after replacing the
rotary embedding hooks the new one.

Caches: with a ``StaticCache`` of plain ``StaticLayer`` s (``cache_implementation="static"``),
which holds [B, Hkv, max_cache_len, D] tensors written at a running offset (exactly the op's
layout), the op writes the new K/V rows itself (``StaticLayer.update``'s bookkeeping is kept).
With any other cache (``DynamicCache``, sliding-window layers, offloading, quantized caches) or
none, the op computes the normalised and rotated Q and K without a cache write and the stock
``cache.update`` stores them, as the stock forward does.

Positions: the attention layers of Qwen3-VL and Qwen3.5 do not receive the mRoPE position
streams (only the text positions), so ``patch`` wraps the model's text rotary embedding to
keep the positions it was called with in this forward; the patched layers read them from there.
In eager mode that wrapper also computes the cos/sin it returns (which only unpatched readers
use) with qkrope's rotary table, one launch, where ``patch`` found it equal to the stock
forward's bit for bit (docs/design.md, "The rotary table").

Under ``torch.compile`` (which ``generate()`` applies to a StaticCache decode step on GPUs)
the op runs as the registered custom op with the same bits, while Inductor computes the *stock*
norm and rotary in fp32 without the eager roundings: the stock compiled model itself then
differs from the stock eager one in ~3% of its keys.
"""

from __future__ import annotations

import ast
import inspect
import math
import numbers
import sys
import warnings
from typing import NamedTuple

import torch
from transformers.cache_utils import StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .._interpret import interpreting
from ..ops._launch import native_ready
from ..ops.qknorm_rope import fused_rope_with_qk_norm_and_kv_cache_update, rope_cos_sin
from ..ops.qknorm_rope.checks import ACTIVATION_DTYPES, HEAD_DIMS, PLAIN_TENSORS, Options
from ..ops.qknorm_rope.registration import op_options, qknorm_rope, qknorm_rope_append

__all__ = ["patch", "unpatch", "is_patched", "patch_qwen3", "unpatch_qwen3", "FallbackWarning",
           "SUPPORTED_ATTENTION"]


class FallbackWarning(UserWarning):
    """A layer (or one call of it) runs the stock transformers forward instead of qkrope's."""


class _Family(NamedTuple):
    gated: bool           # q_proj gives [q | gate] per head; the output is scaled by sigmoid(gate)
    norm_classes: tuple   # the family's RMSNorm classes, by name
    offset_norm: bool     # (1 + w) in fp32, one rounding; else Qwen3RMSNorm's round-then-weight
    partial_rotary: bool  # the rotary may cover fewer dims than head_dim


_QWEN3_NORMS = ("Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Qwen3VLTextRMSNorm", "Qwen3VLMoeTextRMSNorm")
_OFFSET_NORMS = ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
_PLAIN = _Family(gated=False, norm_classes=_QWEN3_NORMS, offset_norm=False, partial_rotary=False)
_GATED = _Family(gated=True, norm_classes=_OFFSET_NORMS, offset_norm=True, partial_rotary=True)

#: Attention classes ``patch`` knows, by class name (transformers' modeling files).
SUPPORTED_ATTENTION = {
    "Qwen3Attention": _PLAIN,
    "Qwen3MoeAttention": _PLAIN,
    "Qwen3VLTextAttention": _PLAIN,
    "Qwen3VLMoeTextAttention": _PLAIN,
    "Qwen3_5Attention": _GATED,
    "Qwen3_5MoeAttention": _GATED,
    "Qwen3NextAttention": _GATED,
}
# Text rotary embeddings -> whether they are interleaved mRoPE (recomposition_frequencies:
# T everywhere, H at 1, 4, ... < 3 * section[1], W at 2, 5, ... < 3 * section[2]).
_ROTARY = {
    "Qwen3RotaryEmbedding": False,
    "Qwen3MoeRotaryEmbedding": False,
    "Qwen3NextRotaryEmbedding": False,
    "Qwen3VLTextRotaryEmbedding": True,
    "Qwen3VLMoeTextRotaryEmbedding": True,
    "Qwen3_5TextRotaryEmbedding": True,
    "Qwen3_5MoeTextRotaryEmbedding": True,
}


class _Static(NamedTuple):
    """What a patched layer needs that is fixed at patch time and is a constant."""

    gated: bool
    norm_rounding: str
    norm_weight_offset: float
    mrope_section: tuple | None  # (T, H, W) frequency counts, interleaved
    eps: float
    cache_kwarg: str             # "cache" (5.24) or "past_key_values" (earlier 5.x)
    # The last patched layer of its rotary embedding: it empties the rotary's state (what the
    # rotary left for the layers of this forward). Under torch.compile a tensor the graph made
    # and left there would be returned by the graph and rebuilt on every CUDA-graph replay;
    # in eager it would outlive the forward (docs/design.md, "Compile route").
    clears_state: bool = False
    # The rotary's at patch time, and the registered op's options string for them: what a
    # compiled call passes the op directly (``_op``) while the rotary still has them (a layer
    # pickled by an older qkrope has none: its compiled calls take the public function).
    rotary_dim: int = 0
    cos_sin_scale: float = 0.0
    op_options: str = ""
    op_options_append: str = ""  # the same with append=True (a StaticLayer's running length)
    # Where the family's norms keep their epsilon, read at every call (a user may change it;
    # a layer pickled by an older qkrope has none: not checked).
    eps_attr: str = ""


#: Every patched layer's constants, by its key (``_qkrope_key``). Under torch.compile a layer's
#: forward reads them as ``_STATIC[key]``: its guards are the key's, one per layer, and the
#: fields' once per distinct key, where fields read from each layer would cost guards per layer
#: on every call of the compiled step (docs/design.md, "Compile route").
_STATIC: dict[str, _Static] = {}


_warned: set[str] = set()


def _warn_call_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"qkrope: a patched attention layer ran its stock forward for a call: "
                      f"{reason} (warned once)", FallbackWarning, stacklevel=4)


# --------------------------------------------------------------------------------------------
# patch time
# --------------------------------------------------------------------------------------------
def _eps_attr(norm) -> str:
    """Where a family's RMSNorm keeps its epsilon (Qwen3: ``variance_epsilon``; Qwen3.5 and
    Qwen3-Next: ``eps``)."""
    return "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"


def _norm_eps(norm) -> float | None:
    eps = getattr(norm, _eps_attr(norm), None)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) \
            or eps < 0:
        return None
    return float(eps)


def _layer_options(m, family: _Family, rotary) -> tuple[str | None, dict]:
    """``(reason, {})`` if the op cannot run layer ``m``, else ``(None, its _Static fields)``."""
    if rotary is None:
        return "no text rotary embedding found beside its decoder layers", {}
    if getattr(sys.modules[type(m).__module__], "ALL_ATTENTION_FUNCTIONS",
               None) is not ALL_ATTENTION_FUNCTIONS:
        return "its modeling file has another attention registry than transformers'", {}
    D = m.head_dim
    if D not in HEAD_DIMS:
        return f"head_dim {D} (the op takes {', '.join(map(str, HEAD_DIMS))})", {}
    tensors = (m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.q_norm.weight,
               m.k_norm.weight)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        return ("q/k/v projection and q/k norm weights differ in dtype ("
                f"{', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))})"), {}
    dtype = dtypes.pop()
    if dtype not in ACTIVATION_DTYPES:
        return (f"{str(dtype).removeprefix('torch.')} weights (the op takes bfloat16 or "
                "float16)"), {}
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return "the layer's weights are on several devices", {}
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        return (f"weights on {device} (the kernel needs CUDA, or TRITON_INTERPRET=1 set before "
                "importing qkrope)"), {}
    for name in ("q_norm", "k_norm"):
        cls = type(getattr(m, name)).__name__
        if cls not in family.norm_classes:
            return (f"{name} is a {cls}, not the family's RMSNorm "
                    f"({' / '.join(family.norm_classes)})"), {}
    eps, k_eps = _norm_eps(m.q_norm), _norm_eps(m.k_norm)
    if eps is None or eps != k_eps:
        return "q_norm and k_norm epsilons differ or are not finite floats >= 0", {}
    half = rotary.inv_freq.numel()
    if rotary.inv_freq.dim() != 1 or not 1 <= half <= D // 2 or (
            not family.partial_rotary and 2 * half != D):
        return f"the rotary embedding covers {2 * half} of head_dim {D} dims", {}
    scale = rotary.attention_scaling
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not (
            math.isfinite(scale) and scale > 0):
        return f"the rotary embedding's attention_scaling is {scale!r}", {}
    section = _mrope_section(rotary, half)
    if section == ():
        return (f"mrope_section {tuple(rotary.mrope_section)!r} does not fit {half} rotary "
                f"frequencies"), {}
    q_out = m.q_proj.out_features // (2 if family.gated else 1)
    Hq, Hkv = q_out // D, m.k_proj.out_features // D
    if Hq * D != q_out or Hkv * D != m.k_proj.out_features or Hkv < 1 or Hq % Hkv:
        return f"projection widths {m.q_proj.out_features}/{m.k_proj.out_features} do not " \
               f"give whole head groups of head_dim {D}", {}
    rounding = "weight_fp32" if family.offset_norm else "hf"
    offset = 1.0 if family.offset_norm else 0.0
    try:
        opts = Options("bhsd", "neox", 2 * half, offset, rounding, float(scale), section,
                       section is not None)
        key, key_append = op_options(opts, D), op_options(opts._replace(append=True), D)
    except (TypeError, ValueError) as err:
        return f"the op refuses its options: {err}", {}
    return None, dict(gated=family.gated, norm_rounding=rounding, norm_weight_offset=offset,
                      mrope_section=section, eps=eps, rotary_dim=2 * half,
                      cos_sin_scale=float(scale), op_options=key, op_options_append=key_append,
                      eps_attr=_eps_attr(m.q_norm))


def _mrope_section(rotary: torch.nn.Module, half: int) -> tuple | None:
    """The op's (T, H, W) interleaved mRoPE section of ``rotary`` with ``half`` frequencies:
    None for a plain rotary, () where its ``mrope_section`` does not fit them."""
    if not _ROTARY[type(rotary).__name__]:
        return None
    sec = tuple(rotary.mrope_section)
    if len(sec) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                            for s in sec) or sec[1] + sec[2] > half:
        return ()
    # Interleaved: the T stream holds every frequency H and W do not take, whatever sec[0].
    return (half - sec[1] - sec[2], sec[1], sec[2])


def _text_rotaries(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(attention module) -> the text rotary embedding of the model that owns its layer."""
    owner = {}
    for parent in model.modules():
        rotary, layers = getattr(parent, "rotary_emb", None), getattr(parent, "layers", None)
        if type(rotary).__name__ in _ROTARY and isinstance(layers, torch.nn.Module):
            for m in layers.modules():
                if type(m).__name__ in SUPPORTED_ATTENTION:
                    owner[id(m)] = rotary
    return owner


def _rotary_forward(self, x, position_ids, *args, **kwargs):
    """The text rotary embedding's forward, keeping this forward's positions for the patched
    layers, and the cos it returned, so a layer can tell it got this call's. In eager mode,
    where :func:`_probe_table` found qkrope's rotary table equal to the stock forward's, the
    table is that one launch instead of the stock forward's ~10 (docs/design.md, "The rotary
    table"); under torch.compile the stock forward, whose cos/sin Inductor drops when no layer
    reads them."""
    state = self._qkrope_state
    table = None
    if not torch.compiler.is_compiling() and not args and not kwargs:
        table = getattr(self, "_qkrope_table", None)  # (None: pickled by an older qkrope)
        if table is not None and (x.dtype is not table.dtype or _tf32() is not table.tf32 or
                                  self.rope_type != table.rope_type or
                                  not (interpreting() or native_ready())):
            table = None
    cos = None
    # As the buffer is (model.to(bf16) casts it): the op and the table read it as fp32, as
    # HF's forward does, so no conversion launches (an unsupported dtype: the op refuses it,
    # and the layers take the stock forward).
    inv_freq = self.inv_freq
    if table is not None:
        try:
            cos, sin = rope_cos_sin(position_ids, inv_freq, table.dtype,
                                    cos_sin_scale=self.attention_scaling,
                                    mrope_section=table.mrope_section,
                                    mrope_interleaved=table.mrope_section is not None)
        except (TypeError, ValueError):  # not the probe's kind of call: as the stock forward
            cos = None
    if cos is None:
        cos, sin = _stock_forward(self, x, position_ids, *args, **kwargs)
        inv_freq = self.inv_freq  # after the stock forward's dynamic update
    state["positions"] = position_ids
    state["inv_freq"] = inv_freq
    state["scale"] = self.attention_scaling  # read here, once per forward, not in every layer
    # (No extra graph output under torch.compile: the last patched layer empties the state.)
    state["cos"] = cos
    return cos, sin


class _Table(NamedTuple):
    """Where a rotary embedding's cos/sin may come from qkrope's table (:func:`_probe_table`)."""

    dtype: torch.dtype           # of the activations (and tables) the probe compared
    tf32: bool                   # cuBLAS's TF32 setting then (a stock matmul's product)
    mrope_section: tuple | None  # interleaved (T, H, W) frequency counts
    rope_type: str               # the probe's (a dynamic type set since must update inv_freq)


def _tf32() -> bool:
    return torch.backends.cuda.matmul.allow_tf32


#: Rotary types whose stock forward updates ``inv_freq`` from the positions it is given.
_DYNAMIC_ROPE = ("dynamic", "longrope")


def _probe_table(rotary: torch.nn.Module, dtype: torch.dtype) -> _Table | None:
    """The table options under which :func:`rope_cos_sin` returns what ``rotary``'s stock
    forward returns for ``dtype`` activations, bit for bit, or None. Decided at patch time by
    running both on probe positions (small and large angles, distinct mRoPE streams): the
    stock forward's formula varies between transformers versions (a batched matmul in 5.17, a
    product from 5.2x) and is not the op's to assume. Rotary types that update ``inv_freq``
    from the positions, an instance forward (a hook of accelerate's), or a non-float
    ``attention_scaling`` keep the stock forward."""
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or any(t in rope_type for t in _DYNAMIC_ROPE) or \
            rotary._qkrope_previous_forward is not None or \
            type(rotary.attention_scaling) is not float:
        return None
    # (patch hooks only rotaries whose layers it fuses: inv_freq 1-D on the op's device, a
    # fitting mRoPE section)
    device, half = rotary.inv_freq.device, rotary.inv_freq.shape[0]
    section = _mrope_section(rotary, half)
    pos = torch.cat([torch.arange(48), torch.tensor([255, 1000, 4095, 8191, 32767, 65535,
                                                     131071, 1048575])]).to(device)[None]
    if section is not None:
        pos = torch.stack([pos, pos // 2 + 3, pos // 3 + 7])
    x = torch.zeros(1, dtype=dtype, device=device)
    try:
        with torch.no_grad():
            want = _stock_forward(rotary, x, pos)
            got = rope_cos_sin(pos, rotary.inv_freq, dtype,
                               cos_sin_scale=rotary.attention_scaling, mrope_section=section,
                               mrope_interleaved=section is not None)
    except Exception:  # noqa: BLE001 (whatever fails here, the stock forward stays)
        return None
    same = len(want) == 2 and all(type(w) is torch.Tensor and w.dtype == g.dtype and
                                  w.shape == g.shape and torch.equal(w, g)
                                  for w, g in zip(want, got))
    return _Table(dtype, _tf32(), section, rope_type) if same else None


def _hook_rotary(rotary: torch.nn.Module, dtype: torch.dtype) -> dict:
    """Hook ``rotary`` (once) and probe its table for ``dtype`` activations (again when
    patched for another dtype); returns its state."""
    if "_qkrope_state" not in rotary.__dict__:
        rotary._qkrope_state = {}
        _swap_class(rotary, "rotary")
    if rotary.__dict__.get("_qkrope_probed") is not dtype:
        rotary._qkrope_table = _probe_table(rotary, dtype)
        rotary._qkrope_probed = dtype
    return rotary._qkrope_state


def _swap_class(m: torch.nn.Module, role: str) -> None:
    """Make ``m`` an instance of its qkrope class for ``role``. A forward set on the instance
    (e.g. an accelerate hook) would shadow the class's: it is kept as what
    :func:`_stock_forward` runs, and is back at unpatch (:func:`_restore_class`)."""
    m._qkrope_previous_forward = m.__dict__.pop("forward", None)
    m.__class__ = _qkrope_class(type(m), role)


def _restore_class(m: torch.nn.Module) -> None:
    m.__class__ = m._qkrope_base
    previous = m.__dict__.pop("_qkrope_previous_forward")
    if previous is not None:
        m.forward = previous


def _stock_forward(self, *args, **kwargs):
    """The forward a patched module had before patch: the one set on the instance, else its
    stock class's."""
    previous = self._qkrope_previous_forward
    if previous is None:
        return self._qkrope_base.forward(self, *args, **kwargs)
    return previous(*args, **kwargs)


_CLASSES: dict[tuple[type, str], type] = {}


def _qkrope_class(base: type, role: str) -> type:
    """``base`` with qkrope's forward for ``role`` ("attention": :func:`_fused_forward`,
    "rotary": :func:`_rotary_forward`), the class of a patched module: a subclass of the same
    name, so ``isinstance`` and the name read as before. A forward set on the instance instead
    costs the compiled step guards per module on every call (the method object, its function,
    code and ``__self__``); one on the class costs none beyond the type check every module has.
    The modeling file's eager attention rides on the class (the stock forward takes it from its
    module; docs/design.md, "Compile route"). Pickled (``torch.save(model)``, ``deepcopy``) as
    the stock class by name plus the role, and made again on load."""
    cls = _CLASSES.get((base, role))
    if cls is None:
        attrs = {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "__doc__": base.__doc__, "_qkrope_base": base, "_qkrope_role": role,
                 "__reduce_ex__": _reduce_ex, "__setstate__": _setstate}
        if role == "attention":
            # (a staticmethod: read through the instance, a plain function would bind self)
            attrs.update(forward=_fused_forward, _qkrope_eager_attention=staticmethod(
                sys.modules[base.__module__].eager_attention_forward))
        else:
            attrs.update(forward=_rotary_forward)
        cls = _CLASSES[base, role] = type(base.__name__, (base,), attrs)
    return cls


def _new_patched(base: type, role: str) -> torch.nn.Module:
    cls = _qkrope_class(base, role)
    return cls.__new__(cls)


def _reduce_ex(self, protocol):
    # The subclass has no importable name: pickle names the stock class instead.
    reduced = object.__reduce_ex__(self, max(protocol, 2))  # (copyreg.__newobj__, (cls,), ...)
    return (_new_patched, (self._qkrope_base, self._qkrope_role), *reduced[2:])


def _setstate(self, state) -> None:
    self._qkrope_base.__setstate__(self, state)
    key = state.get("_qkrope_key")
    if key is not None:  # an attention layer loaded, maybe in another process: its constants,
        # the cache keyword that of the transformers installed here
        static = _Static(*ast.literal_eval(key))
        self._qkrope_key = _register(static._replace(cache_kwarg=_cache_kwarg(self._qkrope_base)))


def _cache_kwarg(cls: type) -> str:
    """The keyword the stock forward of attention class ``cls`` takes the cache from."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _register(static: _Static) -> str:
    """``static``'s key in :data:`_STATIC` (its ``repr``, which ``ast.literal_eval`` reads)."""
    key = repr(tuple(static))
    _STATIC.setdefault(key, static)
    return key


def patch(model: torch.nn.Module) -> int:
    """Route every supported attention layer of ``model`` through qkrope's fused prologue.

    Patch after moving the model to its device and dtype: layers the op cannot run (see the
    module docstring) keep their stock forward, with one :class:`FallbackWarning` per reason.
    Idempotent (a layer whose rotary embedding was replaced since is patched anew); undo with
    :func:`unpatch`.

    Returns:
        The number of attention layers that run the fused prologue after the call.

    Raises:
        ValueError: ``model`` holds no attention layer of a supported family.
    """
    attention = [m for m in model.modules() if type(m).__name__ in SUPPORTED_ATTENTION]
    if not attention:
        raise ValueError(f"qkrope.patch: no Qwen3-family attention layer in "
                         f"{type(model).__name__} (supported: "
                         f"{', '.join(SUPPORTED_ATTENTION)})")
    rotaries = _text_rotaries(model)
    skipped: dict[str, int] = {}
    patched = 0
    for m in attention:
        rotary = rotaries.get(id(m))
        if is_patched(m):
            if rotary is not None and m._qkrope_rotary_state is rotary.__dict__.get(
                    "_qkrope_state"):
                _hook_rotary(rotary, m.q_proj.weight.dtype)  # the table probed anew for a
                patched += 1                                  # dtype changed since
                continue
            _unpatch_layer(m)  # its rotary embedding was replaced: patched anew
        reason, options = _layer_options(m, SUPPORTED_ATTENTION[type(m).__name__], rotary)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        m._qkrope_key = _register(_Static(**options, cache_kwarg=_cache_kwarg(type(m))))
        m._qkrope_params = tuple(m.parameters())  # the autograd check's (_call_reason)
        m._qkrope_rotary_state = _hook_rotary(rotary, m.q_proj.weight.dtype)
        _swap_class(m, "attention")
        patched += 1
    # Layers run in module order (a layer after the one that clears would fall back, not err).
    last = {id(m._qkrope_rotary_state): m for m in attention if is_patched(m)}
    for m in attention:
        if is_patched(m):
            clears = last[id(m._qkrope_rotary_state)] is m
            m._qkrope_key = _register(_STATIC[m._qkrope_key]._replace(clears_state=clears))
    for reason, n in skipped.items():
        warnings.warn(f"qkrope.patch: {n} of {len(attention)} attention layers keep the stock "
                      f"forward: {reason}", FallbackWarning, stacklevel=2)
    return patched


def unpatch(model: torch.nn.Module) -> int:
    """Restore the stock forward of every patched attention layer (and the rotary embeddings
    ``patch`` wrapped); returns the number of attention layers restored."""
    n = 0
    for m in model.modules():
        if is_patched(m):
            _unpatch_layer(m)
            n += 1
        if "_qkrope_state" in m.__dict__:
            _restore_class(m)
            for name in ("_qkrope_state", "_qkrope_table", "_qkrope_probed"):
                m.__dict__.pop(name, None)
    return n


def _unpatch_layer(m: torch.nn.Module) -> None:
    _restore_class(m)
    del m._qkrope_key, m._qkrope_params, m._qkrope_rotary_state


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an attention layer that :func:`patch` routed through qkrope."""
    return "_qkrope_key" in module.__dict__


def patch_qwen3(model: torch.nn.Module) -> int:
    """Former name of :func:`patch` (it now covers the whole Qwen3 family)."""
    return patch(model)


def unpatch_qwen3(model: torch.nn.Module) -> int:
    """Former name of :func:`unpatch`."""
    return unpatch(model)


# --------------------------------------------------------------------------------------------
# call time
# --------------------------------------------------------------------------------------------
_AUTOGRAD = "autograd is recording (the op has no backward; use torch.no_grad())"


def _call_reason(self, static: _Static, state: dict, hidden_states,
                 position_embeddings) -> str | None:
    """Why this call must take the stock forward (cheap checks, no device sync), or None.
    ``state``: what the rotary embedding left in this forward."""
    if self.training:
        return "the module is training (the op has no backward, and no dropout)"
    # The parameters of patch time: a module or parameter set in later (an adapter) is caught
    # by the check of the op's own inputs in _fused_forward.
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            p.requires_grad for p in self._qkrope_params)):
        return _AUTOGRAD
    if static.eps_attr and (getattr(self.q_norm, static.eps_attr) != static.eps or
                            getattr(self.k_norm, static.eps_attr) != static.eps):
        return "the q_norm / k_norm epsilon changed after patch (patch again to fuse)"
    if "positions" not in state:
        return "the model's rotary embedding has not run (no positions for this forward)"
    if position_embeddings is None or position_embeddings[0] is not state["cos"]:
        return ("position_embeddings were not computed by the model's rotary embedding in this "
                "forward")
    return None


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                   **kwargs):
    """Drop-in for the family's attention forward. The cache comes from the keyword the stock
    forward of the installed transformers takes it from (``cache`` from 5.24, before that
    ``past_key_values``); any other keyword goes on to the attention function, as in the stock
    forward (a ``cache=`` given to a 5.17 model is ignored there, so it is here)."""
    static = _STATIC[self._qkrope_key]
    cache = kwargs.pop(static.cache_kwarg, None)
    state = self._qkrope_rotary_state  # what the rotary embedding left in this forward
    if static.clears_state:  # the last layer: a copy to read, the state emptied
        state = dict(state)
        self._qkrope_rotary_state.clear()
    reason = _call_reason(self, static, state, hidden_states, position_embeddings)
    if reason is not None:
        return _stock(self, static, reason, hidden_states, position_embeddings, attention_mask,
                      cache, kwargs)

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    gate = None
    if static.gated:
        # [q | gate] per head: the query is a strided half of each 2 D row, read in place.
        query, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
    else:
        query = self.q_proj(hidden_states).view(hidden_shape)
    query = query.transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or
                                    value.requires_grad or self.q_norm.weight.requires_grad or
                                    self.k_norm.weight.requires_grad):
        return _stock(self, static, _AUTOGRAD, hidden_states, position_embeddings,
                      attention_mask, cache, kwargs)

    try:
        query, key, keys, values = _prologue(self, static, state, query, key, value, cache)
    except (TypeError, ValueError) as err:  # the op's checks: nothing was written
        return _stock(self, static, f"the op rejected it: {err}", hidden_states,
                      position_embeddings, attention_mask, cache, kwargs)
    if keys is None:  # not a plain StaticLayer: the stock cache update stores the rotated rows
        keys, values = key, value
        if cache is not None:
            keys, values = cache.update(key, value, self.layer_idx, kwargs=kwargs)

    # As the stock forward (the modeling files' registry is transformers' one, checked at patch
    # time); the eager function, its default, is read only when it is the one.
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, None) or self._qkrope_eager_attention
    extra = {"sliding_window": self.sliding_window} if hasattr(self, "sliding_window") else {}
    attn_output, attn_weights = attention_interface(
        self, query, keys, values, attention_mask, dropout=0.0, scaling=self.scaling, **extra,
        **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)
    return self.o_proj(attn_output), attn_weights


def _prologue(self, static: _Static, state: dict, query, key, value, cache):
    """The op on one layer's projections: ``(query_rotated, key_rotated, keys, values)``. With
    a plain ``StaticLayer`` it writes the new rows there and returns the layer's whole tensors
    as ``keys, values``; otherwise it writes nothing and they are None. Raises the op's
    TypeError / ValueError before any state changes."""
    positions = state["positions"]
    if static.mrope_section is not None:
        positions = positions.expand(3, -1, -1)  # as the rotary module does: [3, B, S]
    inv_freq = state["inv_freq"]  # the rotary's buffer, as it is (_rotary_forward)
    options = dict(norm_rounding=static.norm_rounding,
                   norm_weight_offset=static.norm_weight_offset,
                   rotary_dim=2 * inv_freq.shape[0],
                   cos_sin_scale=float(state["scale"]),
                   mrope_section=static.mrope_section, mrope_interleaved=True)
    if static.mrope_section is None:
        del options["mrope_section"], options["mrope_interleaved"]
    # The stock norm and rotary keep their input's memory layout ([B, S, H, D] order, the
    # projection's); the attention kernel that runs next may pick another algorithm (other
    # bits) for another layout, so the outputs get that layout too.
    options.update(query_out=torch.empty_like(query), key_out=torch.empty_like(key))

    layer = None
    layers = getattr(cache, "layers", None)
    if layers is not None and self.layer_idx < len(layers) and not getattr(
            cache, "offloading", False) and type(layers[self.layer_idx]) in _PLAIN_STATIC_LAYER:
        layer = layers[self.layer_idx]
    if layer is not None:
        if not layer.is_initialized:
            layer.lazy_initialization(key, value)
        # StaticLayer.update's bookkeeping (rows at the running length, the length advanced,
        # an overflow refused) is the op's own with append=True: one launch a layer, where
        # the stock update takes an index_copy_ a cache and the length's kernels
        # (docs/design.md, "Appending at a running length").
        _check_room(layer, key.shape[2])
        q_rot, k_rot = _op(self, static, query, key, value, positions, layer.keys,
                           layer.values, layer.cumulative_length, inv_freq, options,
                           append=True)
        return q_rot, k_rot, layer.keys, layer.values

    # No cache of the op's layout: one-row stand-in caches whose row every token skips (-1).
    # (Separate allocations: the op refuses caches that share memory, expanded views too.)
    B, Hkv, S, D = key.shape
    k_stand_in = key.new_empty((B, Hkv, 1, D))
    v_stand_in = key.new_empty((B, Hkv, 1, D))
    rows = torch.full((S,), -1, dtype=torch.int64, device=key.device)
    q_rot, k_rot = _op(self, static, query, key, value, positions, k_stand_in, v_stand_in,
                       rows, inv_freq, options)
    return q_rot, k_rot, None, None


def _op(self, static: _Static, query, key, value, positions, key_cache, value_cache, rows,
        inv_freq, options: dict, append: bool = False):
    """The op on a layer's tensors (outputs given in ``options``): ``(q_rot, k_rot)``. Eager:
    the public function (its checks, or the native fast path of a known signature). Under
    torch.compile the registered op itself, whose fake runs the same checks at trace time: the
    public function's checks, traced, would be guards of the compiled step, evaluated before
    every call, CUDA-graph replays included (docs/design.md, "Compile route"). A call the
    checks refuse is then a compile error, not a stock forward. ``append``: ``rows`` is the
    cache's running length, which the op advances."""
    q_weight, k_weight = _local(self.q_norm.weight), _local(self.k_norm.weight)
    direct = static.op_options_append if append else static.op_options
    if not torch.compiler.is_compiling() or not direct or \
            options["rotary_dim"] != static.rotary_dim or \
            options["cos_sin_scale"] != static.cos_sin_scale:
        return fused_rope_with_qk_norm_and_kv_cache_update(
            query, key, value, positions, key_cache, value_cache, rows, q_weight, k_weight,
            inv_freq, static.eps, append=append, **options)[:2]
    q_out, k_out = options["query_out"], options["key_out"]
    (qknorm_rope_append if append else qknorm_rope)(
        query, key, value, positions, key_cache, value_cache, rows, q_weight, k_weight,
        inv_freq, None, None, None, None, None, q_out, k_out, static.eps, direct)
    return q_out, k_out


#: The one cache layer class the op writes: exactly StaticLayer, not its subclasses (sliding
#: windows). Tested as ``type(layer) in`` this set: under torch.compile that is a type check per
#: layer, where ``type(layer) is StaticLayer`` costs a Python-evaluated guard per layer and call.
_PLAIN_STATIC_LAYER = frozenset({StaticLayer})


def _check_room(layer: StaticLayer, seq_len: int) -> None:
    """Refuse a prompt longer than a StaticCache's ``max_cache_len`` (known on the host) with
    the stock ``index_copy_``'s IndexError. Rows past the running length, which lives on the
    device, are the op's device assert (append=True): the stock one raises there too (an
    IndexError on CPU, a device-side assert on a GPU)."""
    room = layer.keys.shape[2]  # max_cache_len, read from the guarded tensor: no guard of its own
    if seq_len > room:
        raise IndexError(f"qkrope: {seq_len} new tokens do not fit a StaticCache of "
                         f"max_cache_len={room}; make the cache larger")


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a weight that tensor parallelism keeps as a (replicated) DTensor,
    as older transformers did for q_norm/k_norm; the kernel addresses plain tensors."""
    if type(weight) in PLAIN_TENSORS:
        return weight
    to_local = getattr(weight, "to_local", None)
    return weight if to_local is None else to_local()


def _stock(self, static: _Static, reason: str, hidden_states, position_embeddings,
           attention_mask, cache, kwargs):
    _warn_call_once(reason)
    return _stock_forward(self, hidden_states, position_embeddings, attention_mask,
                          **{static.cache_kwarg: cache}, **kwargs)
