"""HF transformers integration: Qwen3 / Qwen3-MoE attention with the fused prologue.

``patch_qwen3(model)`` replaces, in every ``Qwen3Attention`` / ``Qwen3MoeAttention`` of the model,
the q_norm + k_norm + rotary + ``StaticCache`` update sequence by one qkrope launch;
``unpatch_qwen3(model)`` restores the stock forward. Supported: transformers 5.x (tested on
5.17 and 5.24). The fused path is taken when

- the layer's cache is a plain ``StaticLayer`` (``cache_implementation="static"`` or a
  ``StaticCache``), which holds [B, Hkv, max_cache_len, D] tensors written at a running
  offset: exactly the op's cache layout;
- the rotary embedding is unscaled (``attention_scaling == 1``; ``inv_freq`` is read from the
  model's rotary module at every call, so dynamic RoPE updates are honoured);
- the module is not training (the op has no backward).

Otherwise the call falls back to the stock forward with a warning (once per reason). The op runs
with ``norm_rounding="hf"``, the rounding of ``Qwen3RMSNorm``: a patched model's tokens and
cache contents equal the stock eager model's bit for bit (tested on CPU and on an H200). Under
``torch.compile`` (which ``generate()`` applies to a StaticCache decode step on GPUs) the op runs
as the registered custom op with the same bits, while Inductor computes the *stock* norm and
rotary in fp32 without the eager roundings: the stock compiled model itself then differs from
the stock eager one in ~3% of its keys.
"""

from __future__ import annotations

import sys
import types
import warnings

import torch

from ..ops.qknorm_rope import fused_rope_with_qk_norm_and_kv_cache_update

__all__ = ["patch_qwen3", "unpatch_qwen3", "is_patched"]

_ATTENTION_CLASSES = ("Qwen3Attention", "Qwen3MoeAttention")
_ROTARY_CLASSES = ("Qwen3RotaryEmbedding", "Qwen3MoeRotaryEmbedding")
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"qkrope: using the stock Qwen3 attention forward: {reason}", stacklevel=3)


def _fallback_reason(module, cache, position_ids) -> str | None:
    from transformers.cache_utils import StaticLayer

    if module.training:
        return "the module is training (qkrope's op has no backward)"
    if cache is None:
        return "no cache was passed (use cache_implementation='static' or a StaticCache)"
    layers = getattr(cache, "layers", None)
    if layers is None or type(layers[module.layer_idx]) is not StaticLayer:
        return f"{type(cache).__name__} is not a StaticCache of plain StaticLayers"
    if position_ids is None:
        return "position_ids were not passed to the attention module"
    if module._qkrope_rotary.attention_scaling != 1.0:
        return "the rotary embedding is scaled (attention_scaling != 1)"
    return None


def _fused_forward(self, hidden_states, position_embeddings, attention_mask,
                   past_key_values=None, cache=None, **kwargs):
    """Drop-in for ``Qwen3Attention.forward`` (both the 5.17 ``past_key_values`` and the 5.24
    ``cache`` keyword are accepted)."""
    cache = cache if cache is not None else past_key_values
    position_ids = kwargs.get("position_ids")
    reason = _fallback_reason(self, cache, position_ids)
    if reason is not None:
        _warn_once(reason)
        cache_kw = self._qkrope_cache_kwarg
        return self._qkrope_stock_forward(hidden_states, position_embeddings, attention_mask,
                                          **{cache_kw: cache}, **kwargs)

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    layer = cache.layers[self.layer_idx]
    if not layer.is_initialized:
        layer.lazy_initialization(key, value)
    # StaticLayer.update's own bookkeeping: rows at a running device-side offset.
    seq_len = key.shape[2]
    rows = torch.arange(seq_len, device=key.device) + layer.cumulative_length
    layer.cumulative_length.add_(seq_len)

    # HF upcasts inv_freq to fp32 in the rotary module (model.to(bf16) casts the buffer).
    inv_freq = self._qkrope_rotary.inv_freq
    if inv_freq.dtype != torch.float32:
        inv_freq = inv_freq.float()
    query, _, keys, values = fused_rope_with_qk_norm_and_kv_cache_update(
        query, key, value, position_ids, layer.keys, layer.values, rows,
        self.q_norm.weight, self.k_norm.weight, inv_freq,
        float(self.q_norm.variance_epsilon), norm_rounding="hf")

    hf = sys.modules[type(self).__module__]  # the model file's own attention registry
    attention_interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, hf.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query, keys, values, attention_mask, dropout=0.0, scaling=self.scaling,
        sliding_window=self.sliding_window, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def patch_qwen3(model: torch.nn.Module) -> int:
    """Route every Qwen3 / Qwen3-MoE attention layer of ``model`` through qkrope.

    Returns the number of attention modules patched. Idempotent; undo with
    :func:`unpatch_qwen3`. Raises ``ValueError`` if the model has no such layer, or a layer's
    q_norm and k_norm epsilons differ.
    """
    import inspect

    rotary = next((m for m in model.modules() if type(m).__name__ in _ROTARY_CLASSES), None)
    attention = [m for m in model.modules() if type(m).__name__ in _ATTENTION_CLASSES]
    if rotary is None or not attention:
        raise ValueError("patch_qwen3: no Qwen3/Qwen3-MoE attention layers or rotary embedding "
                         f"found in {type(model).__name__}")
    for m in attention:
        if m.q_norm.variance_epsilon != m.k_norm.variance_epsilon:
            raise ValueError("patch_qwen3: q_norm and k_norm epsilons differ in layer "
                             f"{m.layer_idx}; the fused op takes one epsilon")
        if is_patched(m):
            continue
        stock = m.forward
        params = inspect.signature(type(m).forward).parameters
        m._qkrope_cache_kwarg = "cache" if "cache" in params else "past_key_values"
        m._qkrope_stock_forward = stock
        m._qkrope_rotary = rotary
        m.forward = types.MethodType(_fused_forward, m)
    return len(attention)


def unpatch_qwen3(model: torch.nn.Module) -> int:
    """Restore the stock forward of every patched attention module; returns how many."""
    n = 0
    for m in model.modules():
        if is_patched(m):
            del m.forward, m._qkrope_stock_forward, m._qkrope_rotary, m._qkrope_cache_kwarg
            n += 1
    return n


def is_patched(module: torch.nn.Module) -> bool:
    return "_qkrope_stock_forward" in module.__dict__
