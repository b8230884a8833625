"""Pure-PyTorch oracle of the op, written independently of the kernel; production code never
imports it. Two entry points share one piece of math:

- :func:`qknorm_rope_cache_ref`: [B, H, S, D] activations, [B, Hkv, L, D] caches, one cache row
  per token for every batch element (the public benchmark's layout);
- :func:`qknorm_rope_paged_ref`: token-major [T, H, D] activations, paged caches addressed per
  token through a slot.

Rounding points, in the order the unfused eager model code has them (each one named where it
happens below):

- R1 norm: RMSNorm in fp32; ``"weight_fp32"``: the weight multiply in fp32, then one rounding
  to the activation dtype; ``"hf"`` (HF's Qwen3RMSNorm): round, then multiply by the weight in
  the activation dtype (a second rounding).
- R2 trig: ``angle = float32(position) * inv_freq`` (one fp32 multiply); cos/sin in fp32, times
  ``cos_sin_scale`` in fp32 (HF's ``attention_scaling``), rounded to the activation dtype.
- R3 rotation: every product and each sum is one eager op in the activation dtype, so rounded
  (HF's ``q * cos + rotate_half(q) * sin``).
- R4 FP8 caches and FP8 query/key outputs: ``saturate(x / scale)`` of the rotated row in the
  activation dtype (R3's result), in fp32, to +-448 and rounded to e4m3, or to +-57344 and
  rounded to e5m2 (nearest even, the sign of zero kept; e5m2 stores no inf); NaN, from the
  data or the scale, is stored as the one NaN code 0x7F, as the GPU's conversion does
  (torch's cast keeps a NaN's sign: 0xFF for a negative NaN, which ``0 / 0`` is on x86).
- R5 per-token-head FP8 / INT8 caches (``k_scale_cache`` / ``v_scale_cache``): per written
  row, ``s = max(amax(|x|) / Q, 1e-6)`` over its D elements (NaN not counted; Q 448 or 127),
  stored ``saturate(x * (1 / s))`` (FP8 as R4; INT8 rounded half away from zero), and ``s``
  into the row's scale (:func:`quantize_token_head`).

By default both return fresh caches (as the public benchmark's reference does) and leave their
arguments untouched; ``inplace=True`` writes the given caches. Scale caches (R5) are written in
place either way (the op refuses ``inplace=False`` with them).
"""

from __future__ import annotations

import torch

__all__ = ["qknorm_rope_cache_ref", "qknorm_rope_paged_ref", "rms_norm_ref", "rope_angles_ref",
           "cos_sin_ref", "rope_cos_sin_ref", "rotate_ref", "qk_rotated_fp64", "quantize",
           "quantize_token_head"]

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FP8_NAN = 0x7F  # the positive NaN of either FP8 dtype: the code the kernel stores for every NaN


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 norm_rounding: str = "weight_fp32", weight_offset: float = 0.0) -> torch.Tensor:
    """R1: per-row RMSNorm over the last dim. x: [..., D] bf16/fp16, weight: [D]."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if norm_rounding == "hf":
        return weight.to(x.dtype) * normed.to(x.dtype)
    return ((weight.float() + weight_offset) * normed).to(x.dtype)


def rope_angles_ref(positions: torch.Tensor, inv_freq: torch.Tensor,
                    mrope_section=None, mrope_interleaved: bool = False) -> torch.Tensor:
    """R2's fp32 angles [..., R/2] for ``positions`` [...] (or [3, ...] with ``mrope_section``).

    mRoPE picks, per frequency, the angle of one of the three position streams (temporal,
    height, width): contiguous sections (Qwen2-VL), or interleaved T H W T H W ... with T
    beyond the H and W sections (Qwen3-VL, Qwen3.5), as transformers' modeling code does.
    """
    freqs = positions.float()[..., None] * inv_freq.float()
    if mrope_section is None:
        return freqs
    if mrope_interleaved:
        out = freqs[0].clone()
        for stream in (1, 2):
            picked = slice(stream, 3 * mrope_section[stream], 3)
            out[..., picked] = freqs[stream][..., picked]
        return out
    chunks = freqs.split(list(mrope_section), dim=-1)
    return torch.cat([chunk[i] for i, chunk in enumerate(chunks)], dim=-1)


def cos_sin_ref(angles: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """R2: cos/sin of fp32 angles, scaled in fp32, rounded to ``dtype``."""
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rope_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                     scale: float = 1.0, mrope_section=None,
                     mrope_interleaved: bool = False):
    """The rotary table (``rope_cos_sin``): R2's cos/sin [B, S, R/2] of ``positions`` [B, S]
    (or [3, B, S], or [B, S] for all three streams, with ``mrope_section``), each repeated
    over both halves of R, as HF's NeoX rotary embeddings return them."""
    if mrope_section is not None and positions.dim() == 2:
        positions = positions.expand(3, -1, -1)
    angles = rope_angles_ref(positions, inv_freq, mrope_section, mrope_interleaved)
    return tuple(torch.cat((x, x), dim=-1) for x in cos_sin_ref(angles, dtype, scale))


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
               style: str = "neox") -> torch.Tensor:
    """R3: rotate the first ``rotary_dim`` dims of x [..., D] by cos/sin [..., rotary_dim/2]
    (broadcastable to x's rotated half); the rest of each row passes through."""
    rot, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if style == "neox":
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:  # gptj: interleaved pairs (2i, 2i+1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, tail), dim=-1)


def _fp8(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``q`` saturated to the FP8 dtype's largest finite value (e4m3 448, e5m2 57344) and
    rounded to it (nearest even); NaN as 0x7F."""
    lim = _FP8_MAX[dtype]
    stored = torch.where(q.isnan(), q, q.clamp(-lim, lim)).to(dtype)
    return torch.where(q.isnan(), _FP8_NAN, stored.view(torch.uint8)).view(dtype)


def quantize(rows: torch.Tensor, cache_dtype: torch.dtype, scale, head_dim_axis: int):
    """R4 for FP8 caches (per-tensor or per-head ``scale``); a plain cast otherwise."""
    if cache_dtype in _FP8_MAX:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=rows.device).reshape(-1)
        if scale.numel() > 1:  # per head
            shape = [1] * rows.dim()
            shape[head_dim_axis] = -1
            scale = scale.view(shape)
        return _fp8(rows.float() / scale, cache_dtype)
    return rows.to(cache_dtype)


def _div(a, b) -> torch.Tensor:
    """``a / b`` rounded once (IEEE) on every device. On a GPU torch divides by a Python
    number as a multiply by its reciprocal (two roundings: the last bit can differ); a tensor
    divisor on the tensor's own device takes the true division."""
    like = a if isinstance(a, torch.Tensor) else b
    a, b = (x if isinstance(x, torch.Tensor) else torch.full_like(like, x) for x in (a, b))
    return a / b


def quantize_token_head(rows: torch.Tensor, cache_dtype: torch.dtype):
    """R5, per-token-head dynamic scales (vLLM's ``fp8_per_token_head`` /
    ``int8_per_token_head``): each row of the last dim gets ``s = max(amax(|x|) / Q, 1e-6)``
    (NaN not counted; Q = 448 for e4m3, 127 for int8) and is stored as ``y = x * (1 / s)``:
    e4m3 as R4, int8 rounded half away from zero (``y +- 0.5``, truncated) and saturated to
    [-128, 127]; an int8 row holding a NaN gets the scale NaN and every code 0 (it reads back
    as NaN). Every operation is one IEEE fp32 rounding. Returns ``(codes, scales)``, the scales
    shaped as ``rows`` without its last dim."""
    x = rows.float()
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(-1)
    if cache_dtype == torch.int8:
        scales = torch.where(x.isnan().any(-1), float("nan"),
                             torch.clamp_min(_div(amax, 127.0), 1e-6))
        y = x * _div(1.0, scales)[..., None]
        z = torch.where(y >= 0, y + 0.5, y - 0.5).clamp(-128, 127)
        codes = torch.where(y.isnan(), 0.0, z).trunc().to(torch.int8)
        return codes, scales
    scales = torch.clamp_min(_div(amax, _FP8_MAX[cache_dtype]), 1e-6)
    return _fp8(x * _div(1.0, scales)[..., None], cache_dtype), scales


def _into(rotated, out, scale):
    """R4 of an output: ``rotated`` [.., H, .., D] (head axis 1) written into the caller's
    ``out`` (quantised when it is FP8), or ``rotated`` itself without one."""
    if out is None:
        return rotated
    new = quantize(rotated, out.dtype, scale, 1)
    if out.dtype in _FP8_MAX:  # copy_ has no float8 kernels everywhere: copy the bytes
        out.view(torch.uint8).copy_(new.view(torch.uint8))
    else:
        out.copy_(new)
    return out


def _norm_rope(query, key, positions, q_norm_weight, k_norm_weight, inv_freq, eps, unsqueeze,
               rotary_style, rotary_dim, norm_weight_offset, norm_rounding, cos_sin_scale,
               mrope_section, mrope_interleaved):
    """R1-R3 on query and key; cos/sin get a head axis at ``unsqueeze``."""
    rotary_dim = rotary_dim or query.shape[-1]
    angles = rope_angles_ref(positions, inv_freq, mrope_section, mrope_interleaved)
    cos, sin = cos_sin_ref(angles, query.dtype, cos_sin_scale)
    cos, sin = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)

    def one(x, w):
        n = rms_norm_ref(x, w, eps, norm_rounding, norm_weight_offset)
        return rotate_ref(n, cos, sin, rotary_dim, rotary_style)

    return one(query, q_norm_weight), one(key, k_norm_weight)


def qknorm_rope_cache_ref(
    query, key, value, position_ids, key_cache, value_cache, cache_position,
    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, *,
    rotary_style: str = "neox", rotary_dim: int | None = None, norm_weight_offset: float = 0.0,
    norm_rounding: str = "weight_fp32", cos_sin_scale: float = 1.0, mrope_section=None,
    mrope_interleaved: bool = False, k_scale=None, v_scale=None, q_scale=None,
    k_scale_cache=None, v_scale_cache=None, query_out=None, key_out=None,
    inplace: bool = False, skip_out_of_range: bool = True, append: bool = False,
):
    """Oracle of :func:`qkrope.fused_rope_with_qk_norm_and_kv_cache_update` (same arguments).

    query [B, Hq, S, D]; key, value [B, Hkv, S, D]; position_ids [B, S] or [1, S] (or
    [3, B|1, S] with ``mrope_section``); caches [B, Hkv, L, D]; cache_position [S] (rows outside
    [0, L) are skipped). ``query_out``/``key_out``: written and returned, quantised with
    ``q_scale``/``k_scale`` when FP8 (R4). ``skip_out_of_range=False`` writes every row with one
    ``index_copy_`` (no host sync, ``torch.compile`` friendly; every row must then be valid).
    ``append``: cache_position is the running length n (one element): rows n .. n + S - 1,
    ``IndexError`` where they leave the cache, and with ``inplace`` n advanced by S.

    Returns ``(query_rotated, key_rotated, key_cache_out, value_cache_out)``.
    """
    B, _, S, _ = query.shape
    length = None
    if append:
        length, n = cache_position, int(cache_position.reshape(()))
        if not 0 <= n <= key_cache.shape[2] - S:
            raise IndexError(f"running length {n}: {S} rows do not fit {key_cache.shape[2]}")
        cache_position = torch.arange(n, n + S, device=key_cache.device)
    positions = position_ids.expand(*position_ids.shape[:-2], B, S)
    q_rot, k_rot = _norm_rope(query, key, positions, q_norm_weight, k_norm_weight, inv_freq,
                              rms_norm_eps, 1, rotary_style, rotary_dim, norm_weight_offset,
                              norm_rounding, cos_sin_scale, mrope_section, mrope_interleaved)
    if not inplace:
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
    rows, k_new, v_new = cache_position.long(), k_rot, value
    if skip_out_of_range:
        # In int64: compared as int32, a bound of 2**31 rows or more would wrap negative.
        L = key_cache.shape[2]
        keep = (rows >= 0) & (rows < L)
        rows, k_new, v_new = rows[keep], k_rot[:, :, keep], value[:, :, keep]
    for cache, new, scale, scale_cache in ((key_cache, k_new, k_scale, k_scale_cache),
                                           (value_cache, v_new, v_scale, v_scale_cache)):
        if scale_cache is not None:  # R5: each row's own scale, written beside it
            new, scales = quantize_token_head(new, cache.dtype)
            scale_cache.index_copy_(2, rows, scales)
        else:
            new = quantize(new, cache.dtype, scale, 1)
        if cache.dtype in _FP8_MAX:  # index_copy_ has no float8 kernels: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.index_copy_(2, rows, new)
    if length is not None and inplace:
        length.add_(S)
    return _into(q_rot, query_out, q_scale), _into(k_rot, key_out, k_scale), key_cache, value_cache


def qknorm_rope_paged_ref(
    query, key, value, positions, key_cache, value_cache, slot_mapping,
    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, *,
    cache_layout: str = "NHD", rotary_style: str = "neox", rotary_dim: int | None = None,
    norm_weight_offset: float = 0.0, norm_rounding: str = "weight_fp32",
    cos_sin_scale: float = 1.0, mrope_section=None, mrope_interleaved: bool = False,
    k_scale=None, v_scale=None, q_scale=None, k_scale_cache=None, v_scale_cache=None,
    query_out=None, key_out=None, inplace: bool = False, skip_out_of_range: bool = True,
):
    """Oracle of :func:`qkrope.fused_qk_norm_rope_paged` (same arguments).

    query [T, Hq, D]; key, value [T, Hkv, D]; positions [T] (or [3, T] with ``mrope_section``);
    caches NHD [num_blocks, block_size, Hkv, D] or HND [num_blocks, Hkv, block_size, D];
    slot_mapping [T]: block ``slot // block_size``, offset ``slot % block_size``; slots outside
    the cache are skipped. ``query_out``/``key_out`` as in :func:`qknorm_rope_cache_ref`.
    ``skip_out_of_range=False`` writes every slot without filtering (no host sync; every slot
    must be valid).

    Returns ``(query_rotated, key_rotated, key_cache_out, value_cache_out)``.
    """
    q_rot, k_rot = _norm_rope(query, key, positions, q_norm_weight, k_norm_weight, inv_freq,
                              rms_norm_eps, -2, rotary_style, rotary_dim, norm_weight_offset,
                              norm_rounding, cos_sin_scale, mrope_section, mrope_interleaved)
    if not inplace:
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1] if cache_layout == "NHD" else key_cache.shape[2]
    slots, k_new, v_new = slot_mapping.long(), k_rot, value
    if skip_out_of_range:
        keep = (slots >= 0) & (slots < key_cache.shape[0] * block_size)  # int64, as above
        slots, k_new, v_new = slots[keep], k_rot[keep], value[keep]
    block, offset = slots // block_size, slots % block_size
    for cache, rows, scale, scale_cache in ((key_cache, k_new, k_scale, k_scale_cache),
                                            (value_cache, v_new, v_scale, v_scale_cache)):
        if scale_cache is not None:  # R5
            rows, scales = quantize_token_head(rows, cache.dtype)
            if cache_layout == "NHD":
                scale_cache[block, offset] = scales
            else:
                scale_cache[block, :, offset] = scales
        else:
            rows = quantize(rows, cache.dtype, scale, 1)
        if cache_layout == "NHD":
            cache[block, offset] = rows
        else:
            cache[block, :, offset] = rows
    return _into(q_rot, query_out, q_scale), _into(k_rot, key_out, k_scale), key_cache, value_cache


def qk_rotated_fp64(query, key, position_ids, q_norm_weight, k_norm_weight, inv_freq, eps):
    """The mathematically exact [B, H, S, D] Q/K results in fp64, independent of the rounding
    points (NeoX, full rotary).

    Only the angle keeps its fp32 multiply (R2 defines it so); norm, trig and rotation are fp64.
    Returns ``((q, q_mag), (k, k_mag))`` where ``*_mag`` is, per element, ``|n1 cos| + |n2 sin|``
    (first half) / ``|n2 cos| + |n1 sin|`` (second half): the scale that rounding errors of the
    products are relative to.
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
