"""Pure-PyTorch oracle for the token-major op with paged caches (serving layouts).

Same rounding points as the [B, H, S, D] op (SPEC §1), generalised the way serving engines
need it: tokens flattened to T, per-token positions, caches addressed per token through a slot
(``block = slot // block_size``, ``offset = slot % block_size``), NeoX or GPT-J rotation,
partial rotary (``rotary_dim < D``: the tail is normalised but not rotated), Gemma-style
``(offset + w)`` norm weights, and FP8 caches stored as ``saturate(x / scale)``.
"""

from __future__ import annotations

import torch

from ..qknorm_rope_cache.reference import rms_norm_ref

__all__ = ["qknorm_rope_paged_ref", "rotate_ref", "FP8_MAX"]

FP8_MAX = {torch.float8_e4m3fn: 448.0}


def rotate_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               rotary_dim: int, style: str) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of x: [T, H, D] (x.dtype) at positions: [T].

    cos/sin are fp32 of one fp32 multiply, rounded to x.dtype; every product and sum is one
    eager op in x.dtype (so rounded), as HF's ``q * cos + rotate_half(q) * sin``.
    """
    angle = positions.float()[:, None] * inv_freq.float()            # [T, rotary_dim/2]
    cos, sin = torch.cos(angle).to(x.dtype)[:, None], torch.sin(angle).to(x.dtype)[:, None]
    rot, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "neox":
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # gptj: interleaved pairs (2i, 2i+1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, tail), dim=-1)


def _paged_rows(cache: torch.Tensor, layout: str, slots: torch.Tensor):
    """(block, offset) index tensors of valid slots and the mask of tokens that have one."""
    block_size = cache.shape[1] if layout == "NHD" else cache.shape[2]
    valid = (slots >= 0) & (slots < cache.shape[0] * block_size)
    s = slots[valid].long()
    return s // block_size, s % block_size, valid


def _store(cache, layout, block, offset, rows, scale):
    """Write rows [T', Hkv, D] at (block, offset); FP8 caches get saturate(x / scale)."""
    if cache.dtype in FP8_MAX:
        lim = FP8_MAX[cache.dtype]
        scale = torch.as_tensor(scale, dtype=torch.float32, device=rows.device)
        if scale.numel() > 1:
            scale = scale.view(1, -1, 1)                              # per head
        rows = (rows.float() / scale).clamp(-lim, lim)
    rows = rows.to(cache.dtype)
    if layout == "NHD":
        cache[block, offset] = rows
    else:
        cache[block, :, offset] = rows


def qknorm_rope_paged_ref(
    query, key, value, positions, key_cache, value_cache, slot_mapping,
    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, *,
    cache_layout: str = "NHD", rotary_style: str = "neox", rotary_dim: int | None = None,
    norm_weight_offset: float = 0.0, norm_rounding: str = "weight_fp32",
    k_scale=None, v_scale=None, skip_out_of_range: bool = True,
):
    """Reference of :func:`qkrope.fused_qk_norm_rope_paged` (same arguments); writes the
    caches in place and returns ``(query_rotated [T, Hq, D], key_rotated [T, Hkv, D])``.

    ``skip_out_of_range=False`` writes every token's slot without filtering (no boolean
    indexing, so no host sync and ``torch.compile``-friendly; every slot must be valid).
    """
    rotary_dim = rotary_dim or query.shape[-1]

    def norm(x, w):
        if norm_weight_offset:
            w = w.float() + norm_weight_offset
        return rms_norm_ref(x, w, rms_norm_eps, norm_rounding)

    q_rot = rotate_ref(norm(query, q_norm_weight), positions, inv_freq, rotary_dim, rotary_style)
    k_rot = rotate_ref(norm(key, k_norm_weight), positions, inv_freq, rotary_dim, rotary_style)
    if skip_out_of_range:
        block, offset, valid = _paged_rows(key_cache, cache_layout, slot_mapping)
        k_new, v_new = k_rot[valid], value[valid]
    else:
        block_size = key_cache.shape[1] if cache_layout == "NHD" else key_cache.shape[2]
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        k_new, v_new = k_rot, value
    _store(key_cache, cache_layout, block, offset, k_new, k_scale)
    _store(value_cache, cache_layout, block, offset, v_new, v_scale)
    return q_rot, k_rot
