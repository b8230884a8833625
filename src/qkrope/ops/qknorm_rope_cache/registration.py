"""``torch.ops.qkrope.qknorm_rope_cache``: the op as a PyTorch custom op, for ``torch.compile``.

Destination-passing: the caller provides ``query_out`` and ``key_out``; the op writes them and
the K/V cache rows and returns nothing, so ``torch.compile`` sees exactly which tensors are
mutated (no functionalisation copy of the caches) and the fake implementation has nothing to
allocate. The public function routes here only while ``torch.compile`` traces: the dispatcher
adds host time to every eager call (benchmarks/e2e_qwen3.py measures both routes), which eager
users should not pay.
"""

from __future__ import annotations

import torch

from .launcher import check_inputs, fused_rope_with_qk_norm_and_kv_cache_update

__all__ = ["qknorm_rope_cache_op", "traced_call"]


@torch.library.custom_op(
    "qkrope::qknorm_rope_cache",
    mutates_args=("key_cache", "value_cache", "query_out", "key_out"),
)
def qknorm_rope_cache_op(
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
    query_out: torch.Tensor,
    key_out: torch.Tensor,
    norm_rounding: str = "weight_fp32",
) -> None:
    """Same tensors as the public op; writes ``query_out`` [B, Hq, S, D], ``key_out``
    [B, Hkv, S, D] and the cache rows in place."""
    fused_rope_with_qk_norm_and_kv_cache_update(
        query, key, value, position_ids, key_cache, value_cache, cache_position,
        q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
        query_out=query_out, key_out=key_out, norm_rounding=norm_rounding)


@qknorm_rope_cache_op.register_fake
def _(query, key, value, position_ids, key_cache, value_cache, cache_position, q_norm_weight,
      k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out, norm_rounding="weight_fp32"
      ) -> None:
    return None


def traced_call(query, key, value, position_ids, key_cache, value_cache, cache_position,
                q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, *, inplace, query_out,
                key_out, validate, norm_rounding):
    """The public op's body while ``torch.compile`` traces it (same contract)."""
    check_inputs(query, key, value, position_ids, key_cache, value_cache, cache_position,
                 q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps)
    if validate:
        L = key_cache.shape[2]
        torch._check(bool(((cache_position >= 0) & (cache_position < L)).all()),
                     lambda: f"cache_position outside the cache [0, {L})")
    if not inplace:
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
    if query_out is None:
        query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if key_out is None:
        key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    torch.ops.qkrope.qknorm_rope_cache(query, key, value, position_ids, key_cache, value_cache,
                                       cache_position, q_norm_weight, k_norm_weight, inv_freq,
                                       float(rms_norm_eps), query_out, key_out, norm_rounding)
    return query_out, key_out, key_cache, value_cache
