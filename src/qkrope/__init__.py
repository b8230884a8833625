"""qkrope: fused GPU kernels for the attention prologue of Qwen3-style models.

``fused_rope_with_qk_norm_and_kv_cache_update`` (alias ``run``) does per-head RMSNorm on Q and
K, NeoX rotary embedding on both, and the K/V cache write in one kernel launch for [B, H, S, D]
activations and [B, Hkv, L, D] caches; ``reference`` is its pure-PyTorch oracle with the same
arguments and rounding points. ``fused_qk_norm_rope_paged`` (and ``fused_qkv_norm_rope_paged``
for a packed QKV) is the serving-layout form: token-major inputs, per-token positions, paged
(optionally FP8) caches; ``reference_paged`` is its oracle.
"""

from . import _interpret  # noqa: F401  (must run before any Triton kernel is defined)
from .ops.qknorm_rope import (
    fused_qk_norm_rope_paged,
    fused_qkv_norm_rope_paged,
    fused_rope_with_qk_norm_and_kv_cache_update,
    split_packed_qkv,
    vllm_per_token_head_views,
)
from .ops.qknorm_rope.reference import qknorm_rope_cache_ref, qknorm_rope_paged_ref

reference = qknorm_rope_cache_ref
reference_paged = qknorm_rope_paged_ref
#: The benchmark's calling convention: ``run(query, key, value, ..., rms_norm_eps)``.
run = fused_rope_with_qk_norm_and_kv_cache_update

try:
    from importlib.metadata import version as _version

    __version__ = _version("qkrope")
except Exception:  # pragma: no cover - source tree without installed metadata
    __version__ = "0+unknown"

__all__ = ["fused_rope_with_qk_norm_and_kv_cache_update", "fused_qk_norm_rope_paged",
           "fused_qkv_norm_rope_paged", "reference", "reference_paged", "run",
           "split_packed_qkv", "vllm_per_token_head_views", "__version__"]
