"""``torch.ops.qkrope.qk_norm_rope_paged``: the paged op as a PyTorch custom op, used while
``torch.compile`` traces :func:`qkrope.fused_qk_norm_rope_paged` (destination-passing: the
outputs and both caches are declared mutated, nothing is returned, the fake does nothing)."""

from __future__ import annotations

import torch

from .launcher import launch_paged

__all__ = ["qk_norm_rope_paged_op"]


@torch.library.custom_op(
    "qkrope::qk_norm_rope_paged",
    mutates_args=("key_cache", "value_cache", "query_out", "key_out"),
)
def qk_norm_rope_paged_op(
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
    query_out: torch.Tensor,
    key_out: torch.Tensor,
    cache_layout: str,
    rotary_style: str,
    rotary_dim: int,
    norm_weight_offset: float,
    norm_rounding: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Checked arguments of the public op; scales as fp32 device tensors (1 or Hkv) or None."""
    launch_paged(query, key, value, positions, key_cache, value_cache, slot_mapping,
                 q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out,
                 cache_layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                 k_scale, v_scale)


@qk_norm_rope_paged_op.register_fake
def _(query, key, value, positions, key_cache, value_cache, slot_mapping, q_norm_weight,
      k_norm_weight, inv_freq, rms_norm_eps, query_out, key_out, cache_layout, rotary_style,
      rotary_dim, norm_weight_offset, norm_rounding, k_scale, v_scale) -> None:
    return None
