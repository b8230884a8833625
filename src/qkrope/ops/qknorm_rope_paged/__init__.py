"""Token-major QK RMSNorm + RoPE + paged K/V cache write (serving layouts), one launch."""

from .launcher import fused_qk_norm_rope_paged, fused_qkv_norm_rope_paged, split_packed_qkv
from .reference import qknorm_rope_paged_ref
from .registration import qk_norm_rope_paged_op

__all__ = ["fused_qk_norm_rope_paged", "fused_qkv_norm_rope_paged", "qk_norm_rope_paged_op",
           "qknorm_rope_paged_ref", "split_packed_qkv"]
