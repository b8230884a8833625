"""Fused per-head QK RMSNorm + RoPE + K/V cache write, one launch, two entry points.

``api.py`` (the public functions) -> ``checks.py`` (argument checks, canonical options) ->
``registration.py`` (the ``torch.ops.qkrope.qknorm_rope`` custom op) -> ``launcher.py``
(layout adapters, tile picker, launch) -> ``kernel.py`` (the op's Triton kernel; its quantised
stores in ``quantize.py``); ``rope_cos_sin`` takes the same path to the rotary table's kernel
(HF's cos/sin from the op's trig, for callers that hand them on);
``validation.py`` (``validate=True``'s value checks); ``reference.py`` (the oracle, never
imported by production code).
"""

from .api import (
    fused_qk_norm_rope_paged,
    fused_qkv_norm_rope_paged,
    fused_rope_with_qk_norm_and_kv_cache_update,
    rope_cos_sin,
    split_packed_qkv,
    vllm_per_token_head_views,
)

__all__ = ["fused_qk_norm_rope_paged", "fused_qkv_norm_rope_paged",
           "fused_rope_with_qk_norm_and_kv_cache_update", "rope_cos_sin", "split_packed_qkv",
           "vllm_per_token_head_views"]
