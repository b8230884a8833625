"""Pure-PyTorch oracle for the fused QK-norm + RoPE + KV-cache-update op.

This is the semantics every kernel in this folder is checked against (SPEC.md §1). It runs
eagerly on any device and reproduces the rounding points of the unfused HF-style model code:

1. RMSNorm in fp32, weight multiply in fp32, then one rounding to the activation dtype.
2. ``angle = float32(position) * inv_freq`` (one fp32 multiply); ``cos``/``sin`` in fp32, rounded
   to the activation dtype.
3. NeoX rotation with every product and the final sum rounded to the activation dtype, as eager
   bf16/fp16 PyTorch does.
"""

from __future__ import annotations

import torch

__all__ = ["qknorm_rope_cache_ref", "rope_cos_sin_ref", "rms_norm_ref", "rotate_neox_ref",
           "qk_rotated_fp64"]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 norm_rounding: str = "weight_fp32") -> torch.Tensor:
    """Per-row RMSNorm over the last dim. x: [..., D] bf16/fp16, weight: [D]; returns x.dtype.

    ``"weight_fp32"``: the weight multiply happens in fp32 *before* the single rounding to
    ``x.dtype``. ``"hf"``: HF's ``Qwen3RMSNorm``, rounding first, then the weight multiply in
    ``x.dtype``.
    """
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = xf * torch.rsqrt(variance + eps)
    if norm_rounding == "hf":
        return weight.to(x.dtype) * normed.to(x.dtype)
    return (weight.float() * normed).to(x.dtype)


def rope_cos_sin_ref(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables. position_ids: [B, S] int; inv_freq: [D/2] fp32 -> two [B, S, D/2] ``dtype``."""
    angle = position_ids.float()[..., None] * inv_freq.float()
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rotate_neox_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX ("rotate half") rotation. x: [B, H, S, D]; cos/sin: [B, S, D/2] of x.dtype.

    Each product and each sum is a separate eager op, so each is rounded to x.dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def valid_cache_rows(cache_position: torch.Tensor, cache_len: int) -> torch.Tensor:
    """Boolean [S] mask of the tokens whose cache row lies in [0, cache_len); others are skipped."""
    return (cache_position >= 0) & (cache_position < cache_len)


def qknorm_rope_cache_ref(
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
    *,
    inplace: bool = True,
    skip_out_of_range: bool = True,
    norm_rounding: str = "weight_fp32",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference QK-norm + RoPE + KV-cache write (same arguments as the fused op).

    Args:
        query: [B, Hq, S, D] bf16/fp16.
        key, value: [B, Hkv, S, D], dtype of ``query``.
        position_ids: [B, S] (or [1, S], broadcast) int32/int64 rotary positions.
        key_cache, value_cache: [B, Hkv, L, D], dtype of ``query``.
        cache_position: [S] int32/int64 cache rows; rows outside [0, L) are skipped.
        q_norm_weight, k_norm_weight: [D], dtype of ``query``.
        inv_freq: [D/2] fp32.
        rms_norm_eps: RMSNorm epsilon.
        inplace: write into the given caches and return them; else return fresh copies.
        skip_out_of_range: drop tokens whose cache row is outside [0, L), as the fused op does.
            False writes every row with one ``index_copy_`` (no host sync, ``torch.compile``
            friendly; an out-of-range row then raises inside ``index_copy_``).
        norm_rounding: ``"weight_fp32"`` or ``"hf"``, see :func:`rms_norm_ref`.

    Returns:
        ``(query_rotated [B, Hq, S, D], key_rotated [B, Hkv, S, D], key_cache_out, value_cache_out)``.
    """
    B, _, S, _ = query.shape
    cos, sin = rope_cos_sin_ref(position_ids.expand(B, S), inv_freq, query.dtype)
    q_rot = rotate_neox_ref(rms_norm_ref(query, q_norm_weight, rms_norm_eps, norm_rounding),
                            cos, sin)
    k_rot = rotate_neox_ref(rms_norm_ref(key, k_norm_weight, rms_norm_eps, norm_rounding),
                            cos, sin)

    if not inplace:
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
    rows, k_new, v_new = cache_position.long(), k_rot, value
    if skip_out_of_range:
        keep = valid_cache_rows(cache_position, key_cache.shape[2])
        rows, k_new, v_new = rows[keep], k_rot[:, :, keep], value[:, :, keep]
    key_cache.index_copy_(2, rows, k_new)
    value_cache.index_copy_(2, rows, v_new)
    return q_rot, k_rot, key_cache, value_cache


def qk_rotated_fp64(query, key, position_ids, q_norm_weight, k_norm_weight, inv_freq, eps):
    """The mathematically exact Q/K results in fp64, independent of the rounding points.

    Only the angle keeps its fp32 multiply (SPEC step 2 defines it so); norm, trig and rotation
    are fp64. Returns ``((q, q_mag), (k, k_mag))`` where ``*_mag`` is, per element,
    ``|n1 cos| + |n2 sin|`` (first half) / ``|n2 cos| + |n1 sin|`` (second half): the scale that
    rounding errors of the products are relative to.
    """
    B, _, S, _ = query.shape
    angle = (position_ids.expand(B, S).float()[..., None] * inv_freq.float()).double()
    c, s = angle.cos()[:, None], angle.sin()[:, None]

    def one(x, w):
        x = x.double()
        n = w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        n1, n2 = n.chunk(2, -1)
        exact = torch.cat((n1 * c - n2 * s, n2 * c + n1 * s), -1)
        mag = torch.cat(((n1 * c).abs() + (n2 * s).abs(), (n2 * c).abs() + (n1 * s).abs()), -1)
        return exact, mag

    return one(query, q_norm_weight), one(key, k_norm_weight)
