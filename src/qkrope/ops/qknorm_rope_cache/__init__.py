"""Fused per-head QK RMSNorm + NeoX RoPE + K/V cache write (SPEC.md §1)."""

from .launcher import check_inputs, fused_rope_with_qk_norm_and_kv_cache_update, pick_config
from .reference import qknorm_rope_cache_ref
from .registration import qknorm_rope_cache_op

__all__ = [
    "check_inputs",
    "fused_rope_with_qk_norm_and_kv_cache_update",
    "pick_config",
    "qknorm_rope_cache_op",
    "qknorm_rope_cache_ref",
]
