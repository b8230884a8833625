"""The op's public entry points: thin, documented wrappers over one checked launch path.

A call goes public function -> (a repeated signature: the native fast path) -> ``checks.py`` ->
:func:`registration.qknorm_rope` -> :func:`launcher.launch`. Both entry points run the same
kernel; they differ only in how activations and caches are laid out:

===============================================  ==================================================
``fused_rope_with_qk_norm_and_kv_cache_update``  [B, H, S, D] activations, [B, Hkv, L, D] caches,
                                                 one cache row per token for every batch
                                                 element (``cache_position``); returns 4
                                                 tensors, the public benchmark's convention.
``fused_qk_norm_rope_paged``                     token-major [T, H, D] activations, paged caches
                                                 addressed per token (``slot_mapping``); returns
                                                 2 tensors, the caches written in place (serving
                                                 engines' convention).
===============================================  ==================================================
"""

from __future__ import annotations

import torch

from .checks import (
    ACTIVATION_DTYPES, TABLE_DTYPES, Options, check_bhsd, check_cos_sin, check_out, check_paged,
    check_scales, dtype_name, head_count, refuse_autograd, tensor_arg,
)
from .launcher import APPEND_LAUNCHER, COS_SIN_LAUNCHER, LAUNCHER, launch_cos_sin
from .registration import options_key, qknorm_rope, qknorm_rope_append
from .validation import (
    check_room, check_rows, check_scale, validated_rows, validated_scale,
)

__all__ = ["fused_rope_with_qk_norm_and_kv_cache_update", "fused_qk_norm_rope_paged",
           "fused_qkv_norm_rope_paged", "split_packed_qkv", "vllm_per_token_head_views",
           "rope_cos_sin"]


def fused_rope_with_qk_norm_and_kv_cache_update(
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
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
    validate: bool = False,
    norm_rounding: str = "weight_fp32",
    rotary_style: str = "neox",
    rotary_dim: int | None = None,
    norm_weight_offset: float = 0.0,
    cos_sin_scale: float = 1.0,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    append: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm on Q and K, RoPE on both, and the K/V cache write, in one launch.

    Args:
        query: [B, Hq, S, D] bf16 or fp16, any strides (e.g. a view of a fused QKV projection,
            or the query half of a gated ``[q | gate]`` projection); D in {64, 128, 256, 512}.
        key: [B, Hkv, S, D], dtype of ``query``; ``Hq % Hkv == 0``.
        value: [B, Hkv, S, D], dtype of ``query``; copied unchanged into ``value_cache``.
        position_ids: [B, S] int32/int64 rotary positions; [1, S] and expanded views (batch
            stride 0) are accepted. With ``mrope_section``: [3, B, S] (or [3, 1, S]), the
            temporal, height and width position streams.
        key_cache, value_cache: [B, Hkv, L, D], dtype of ``query``, ``float8_e4m3fn`` or
            ``float8_e5m2`` (per-tensor / per-head scales), identical shapes.
        cache_position: [S] int32/int64, the cache row each token's K/V goes to (same for every
            batch element). Rows outside ``[0, L)`` are skipped: -1 is the usual padding marker.
            If two tokens name the same row, each element of that row ends up holding the value
            of one of them, unspecified which (tokens may mix within the row, as with
            ``index_copy_`` on CUDA); every other row is untouched. With ``append=True``: the
            cache's running length n instead, one int64 ([] or [1], e.g. HF's
            ``StaticLayer.cumulative_length``), which the call advances.
        q_norm_weight, k_norm_weight: [D], dtype of ``query``.
        inv_freq: [rotary_dim/2] rotary inverse frequencies, float32, bf16 or fp16 (read as
            float32, as HF's rotary embeddings read a buffer that model.to(bf16) cast).
        rms_norm_eps: RMSNorm epsilon (Python float).
        inplace: True (default) writes the S rows into ``key_cache``/``value_cache`` and returns
            those same tensors: one launch, no cache copy. False leaves them untouched and returns
            fresh copies with the rows written (costs a full copy of both caches); refused with
            ``k_scale_cache``/``v_scale_cache``, which are written in any case.
        query_out, key_out: optional preallocated outputs ([B, Hq, S, D] / [B, Hkv, S, D], any
            strides) for allocation-free calls (CUDA graphs), of ``query``'s dtype,
            ``float8_e4m3fn`` or ``float8_e5m2`` (quantised output, with ``q_scale`` /
            ``k_scale``). ``query_out``
            may be ``query`` itself (and ``key_out`` ``key``); no other overlap is allowed.
        validate: also raise ``ValueError`` when ``cache_position`` leaves ``[0, L)`` or an FP8
            scale tensor holds a value that is not finite and > 0 (costs a host sync, so it is
            off by default and such rows are skipped silently).
        norm_rounding: ``"weight_fp32"`` (default; the public benchmark's): the weight multiply
            happens in fp32 before the one rounding of the normalized row. ``"hf"``: as HF
            transformers' ``Qwen3RMSNorm``, the normalized row is rounded first and then
            multiplied by the weight in the activation dtype (a second rounding).
        rotary_style: ``"neox"`` (rotate halves, Qwen/Llama) or ``"gptj"`` (interleaved pairs
            2i, 2i+1).
        rotary_dim: rotate only the first ``rotary_dim`` dims (even, <= D; e.g. Qwen3.5's
            ``partial_rotary_factor``); the rest of each row is normalised and passed through.
        norm_weight_offset: the norm weight is ``offset + w`` in fp32 (1.0: Gemma, Qwen3.5 and
            Qwen3-Next norms).
        cos_sin_scale: multiplies cos and sin in fp32 before their rounding (HF's
            ``attention_scaling`` of YaRN / LongRoPE rotary embeddings).
        mrope_section: (temporal, height, width) frequency counts of multimodal RoPE, summing to
            rotary_dim/2; each frequency rotates by the position of its stream.
        mrope_interleaved: False: contiguous sections (Qwen2-VL); True: interleaved T H W T H W
            ... with T beyond the H and W sections (Qwen3-VL, Qwen3.5).
        k_scale, v_scale: the scales of FP8 K (an FP8 ``key_cache`` and/or ``key_out``) and
            of an FP8 ``value_cache``, required there and refused elsewhere: Python float, or
            float32 tensor of 1 (per tensor) or Hkv (per head) elements. Stored value =
            saturate(x / scale) to +-448 (e4m3) or +-57344 (e5m2) from the rotated row in the
            activation dtype, nearest even, NaN kept (vLLM's convention); read back as
            stored * scale.
        q_scale: the scale of an FP8 ``query_out`` (1 or Hq elements), as ``k_scale``.
        k_scale_cache, v_scale_cache: per-token-head dynamic scales of an FP8 ``key_cache`` /
            ``value_cache`` instead of ``k_scale`` / ``v_scale`` (vLLM's
            ``fp8_per_token_head``): float32, the cache's shape without D ([B, Hkv, L]; paged
            NHD [num_blocks, block_size, Hkv], HND [num_blocks, Hkv, block_size]), any strides
            (e.g. the float32 views between the rows of vLLM's packed cache:
            :func:`qkrope.vllm_per_token_head_views`). Each written row is stored as
            ``saturate(x * (1 / s))`` with ``s = max(amax(|x|) / Q, 1e-6)`` over its D
            elements (NaN not counted), and ``s`` is written to the row's scale; read back as
            stored * s. Q = 448 for a float8_e4m3fn cache; an int8 cache (vLLM's
            ``int8_per_token_head``) takes Q = 127, rounds half away from zero and gives a row
            holding a NaN the scale NaN (it reads back as NaN). Skipped rows keep their data
            and scale.
        append: True: ``cache_position`` is the running length n; the S tokens go to rows
            n .. n + S - 1 and the call leaves n + S in ``cache_position`` (after every read
            of n, in the same launch: HF StaticLayer.update's bookkeeping, without its
            kernels). A call where n < 0 or n + S > L is a device-side assert on a GPU (the
            CUDA context ends, as after HF's ``index_copy_`` there; rows may have been
            written), an ``IndexError`` before any write in Triton's interpreter. Needs
            ``inplace=True``.

    Returns:
        ``(query_rotated, key_rotated, key_cache_out, value_cache_out)``.
    """
    opts = _fast_key("bhsd", rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                     cos_sin_scale, mrope_section, mrope_interleaved, query, append)
    # (Python float scales go to the native signature as they are: docs/design.md, "Native
    # launch route".)
    if inplace and not validate and not torch.compiler.is_compiling() and _plain(opts):
        out = (APPEND_LAUNCHER if append else LAUNCHER).fast_call(
            opts, (query, key, value, position_ids, key_cache, value_cache, cache_position,
                   q_norm_weight, k_norm_weight, inv_freq, k_scale, v_scale, q_scale,
                   k_scale_cache, v_scale_cache), (query_out, key_out), (rms_norm_eps,))
        if out is not None:
            return (*out, key_cache, value_cache)
    checked = check_bhsd(query, key, value, position_ids, key_cache, value_cache,
                         cache_position, q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
                         Options(*opts))
    if not inplace:
        if checked.append:  # the copies' rows would land at the caller's running length
            raise ValueError("inplace=False copies the caches but not cache_position, which "
                             "append=True advances: pass inplace=True")
        for name, scale_cache in (("k_scale_cache", k_scale_cache),
                                  ("v_scale_cache", v_scale_cache)):
            if scale_cache is not None:  # the copies' scales would land in the caller's
                raise ValueError(f"inplace=False copies the caches but not {name}, which the "
                                 f"call writes: pass inplace=True, or copies of the caches and "
                                 f"of {name}")
        key_cache, value_cache = key_cache.clone(), value_cache.clone()
    query_out, key_out = _checked_call(
        checked, (query, key, value, position_ids, key_cache, value_cache, cache_position,
                  q_norm_weight, k_norm_weight, inv_freq), (k_scale, v_scale, q_scale),
        (k_scale_cache, v_scale_cache), query_out, key_out, rms_norm_eps, validate,
        rows_bound=key_cache.shape[2],
        rows_name="cache_position")
    return query_out, key_out, key_cache, value_cache


def fused_qk_norm_rope_paged(
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
    *,
    cache_layout: str = "NHD",
    rotary_style: str = "neox",
    rotary_dim: int | None = None,
    norm_weight_offset: float = 0.0,
    norm_rounding: str = "weight_fp32",
    cos_sin_scale: float = 1.0,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    q_scale: float | torch.Tensor | None = None,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
    query_out: torch.Tensor | None = None,
    key_out: torch.Tensor | None = None,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major QK RMSNorm + RoPE + paged K/V cache write, in one launch (serving layouts).

    Args:
        query: [T, Hq, D] bf16/fp16, any strides (e.g. from :func:`split_packed_qkv`);
            D in {64, 128, 256, 512}.
        key, value: [T, Hkv, D], dtype of ``query``; ``Hq % Hkv == 0``.
        positions: [T] int32/int64 rotary position of each token (sequences may sit anywhere);
            [3, T] with ``mrope_section``.
        key_cache, value_cache: paged caches, ``cache_layout="NHD"``: [num_blocks, block_size,
            Hkv, D]; ``"HND"``: [num_blocks, Hkv, block_size, D]; dtype of ``query``,
            ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; any strides: separate tensors or
            views of one allocation (e.g. vLLM's packed [num_blocks, Hkv, block_size, 2 D], K
            and V its two halves). A contiguous per-sequence cache [B, Hkv, L, D] is ``"HND"``
            with block_size L: slot ``b * L + row``.
        slot_mapping: [T] int32/int64; token t goes to block ``slot // block_size``, offset
            ``slot % block_size``. Slots < 0 (CUDA-graph padding) or past the cache are skipped.
            A slot named twice ends up holding one of its tokens' values per element, unspecified
            which (as ``cache_position``'s repeated rows).
        q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, rotary_style, rotary_dim,
        norm_weight_offset, norm_rounding, cos_sin_scale, mrope_section, mrope_interleaved,
        k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache: as in
            :func:`fused_rope_with_qk_norm_and_kv_cache_update`.
        cache_layout: ``"NHD"`` (vLLM's default) or ``"HND"``.
        query_out, key_out: optional preallocated outputs of the input shapes, of the input
            dtype, ``float8_e4m3fn`` or ``float8_e5m2`` (with ``q_scale`` / ``k_scale``);
            ``query_out`` may be
            ``query`` itself (and ``key_out`` ``key``); no other overlap is allowed.
        validate: also raise ``ValueError`` for a slot outside the cache or a bad FP8 scale
            value (a host sync).

    Returns:
        ``(query_rotated [T, Hq, D], key_rotated [T, Hkv, D])``; the caches are written in place.
    """
    opts = _fast_key(cache_layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                     cos_sin_scale, mrope_section, mrope_interleaved, query, False)
    if not validate and not torch.compiler.is_compiling() and cache_layout in _PAGED and \
            _plain(opts):
        out = LAUNCHER.fast_call(opts, (query, key, value, positions, key_cache, value_cache,
                                        slot_mapping, q_norm_weight, k_norm_weight, inv_freq,
                                        k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache),
                                 (query_out, key_out), (rms_norm_eps,))
        if out is not None:
            return out
    checked = check_paged(query, key, value, positions, key_cache, value_cache, slot_mapping,
                          q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps, Options(*opts))
    bs = key_cache.shape[1] if checked.layout == "NHD" else key_cache.shape[2]
    return _checked_call(
        checked, (query, key, value, positions, key_cache, value_cache, slot_mapping,
                        q_norm_weight, k_norm_weight, inv_freq), (k_scale, v_scale, q_scale),
        (k_scale_cache, v_scale_cache), query_out, key_out, rms_norm_eps, validate,
        rows_bound=key_cache.shape[0] * bs,
        rows_name="slot_mapping")


def _checked_call(checked: Options, tensors: tuple, scales: tuple, scale_caches: tuple,
                  query_out, key_out, rms_norm_eps, validate: bool, rows_bound: int,
                  rows_name: str):
    """The checked path shared by both entry points; ``tensors``: the ten input tensors in
    the kernel's order, already checked; ``scales``: the caller's ``(k_scale, v_scale,
    q_scale)``, ``scale_caches`` its ``(k_scale_cache, v_scale_cache)``; ``checked``: the
    canonical options."""
    query, key, key_cache, value_cache = tensors[0], tensors[1], tensors[4], tensors[5]
    query_out, key_out = _outputs(query, key, query_out, key_out)
    scales, (k_cache_scales, v_cache_scales) = check_scales(
        query, key, key_cache, value_cache, query_out, key_out, scales, scale_caches)
    if validate:
        rows, scales = _validate(tensors[6], rows_bound, rows_name, scales,
                                 query.shape[-2] if checked.append else None)
        tensors = (*tensors[:6], rows, *tensors[7:])
    refuse_autograd(checked.layout, (*tensors, query_out, key_out),
                    **dict(zip(_SCALE_NAMES, scales)), k_scale_cache=k_cache_scales,
                    v_scale_cache=v_cache_scales)
    (qknorm_rope_append if checked.append else qknorm_rope)(
        *tensors, *scales, k_cache_scales, v_cache_scales, query_out, key_out,
        float(rms_norm_eps), options_key(checked))
    return query_out, key_out


def _fast_key(layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
              cos_sin_scale, mrope_section, mrope_interleaved, query, append) -> tuple:
    """The options as the fast path's key: equal to the canonical :class:`Options` the checks
    return for valid arguments (``rotary_dim`` None is head_dim), so eager calls and the
    registered op's body (which gets canonical options) share one plan per signature."""
    if rotary_dim is None and type(query) is torch.Tensor and query.dim():
        rotary_dim = query.shape[-1]
    if type(mrope_section) is list:
        mrope_section = tuple(mrope_section)
    return (layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding, cos_sin_scale,
            mrope_section, mrope_interleaved, append)


_PAGED = ("NHD", "HND")
_NUMBER = (int, float)


def _plain(opts: tuple) -> bool:
    """Whether ``opts`` (:func:`_fast_key`) have the types the checks make canonical, so a plan
    found by them is the one the checks would pick: a value that only compares equal (True for
    1.0, 1 for True, numpy scalars) goes to the checks, which name its type."""
    _, style, rotary_dim, offset, rounding, scale, section, interleaved, append = opts
    return (type(style) is str and type(rounding) is str and type(rotary_dim) is int and
            type(offset) in _NUMBER and type(scale) in _NUMBER and type(interleaved) is bool and
            type(append) is bool and
            (section is None or (type(section) is tuple and all(type(x) is int
                                                                for x in section))))


_SCALE_NAMES = ("k_scale", "v_scale", "q_scale")


def _validate(rows: torch.Tensor, bound: int, name: str, scales: tuple,
              appended: int | None) -> tuple:
    """``validate=True``: rows/slots inside the cache, FP8 scale values finite and > 0
    (``ValueError`` naming the argument). Returns ``(rows, scales)`` for the launch: under
    torch.compile checked copies, so the checks run in the graph, before the kernel.
    ``appended``: with ``append=True``, S: ``rows`` is the running length, which must leave
    room for S rows; it is the tensor the launch advances, so never a copy, and under
    torch.compile its check is the kernel's own device assert."""
    if torch.compiler.is_compiling():
        return (rows if appended is not None else validated_rows(rows, bound, name),
                tuple(None if s is None else validated_scale(s, n)
                      for n, s in zip(_SCALE_NAMES, scales)))
    if appended is not None:
        check_room(rows, appended, bound, name)
    else:
        check_rows(rows, bound, name)
    for n, s in zip(_SCALE_NAMES, scales):
        if s is not None:
            check_scale(s, n)
    return rows, scales


def _outputs(query, key, query_out, key_out):
    """The caller's checked ``query_out``/``key_out``, or new contiguous ones like q and k
    (plain torch calls: traceable)."""
    if query_out is None:
        query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        check_out("query_out", query_out, query)
    if key_out is None:
        key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    else:
        check_out("key_out", key_out, key)
    return query_out, key_out


def split_packed_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """Views q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] of a packed projection output
    ``qkv`` [T, (Hq + 2 Hkv) * D] (no copy)."""
    tensor_arg("qkv", qkv, 2, ACTIVATION_DTYPES)
    return _split(qkv, num_q_heads, num_kv_heads, head_count("head_dim", head_dim), "head_dim")


def _split(qkv: torch.Tensor, num_q_heads, num_kv_heads, d: int, d_name: str):
    """:func:`split_packed_qkv` with head_dim ``d`` checked; ``d_name`` says where the caller
    gave it (errors name it)."""
    hq, hkv = head_count("num_q_heads", num_q_heads), head_count("num_kv_heads", num_kv_heads)
    width = (hq + 2 * hkv) * d
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must have shape [T, {width}] ((num_q_heads + 2 num_kv_heads) * "
                         f"{d_name}), got {list(qkv.shape)}")
    T = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    return q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)


def vllm_per_token_head_views(kv_cache: torch.Tensor, head_size: int,
                              dtype: torch.dtype | None = None):
    """Views of one layer of vLLM's ``fp8_per_token_head`` (``dtype=torch.int8``:
    ``int8_per_token_head``) KV cache for :func:`fused_qk_norm_rope_paged`
    (``cache_layout="NHD"``): ``(key_cache, value_cache, k_scale_cache, v_scale_cache)``.
    ``dtype`` None: the cache's own dtype where it is int8 or float8_e4m3fn, float8_e4m3fn for
    uint8; a ``dtype`` that contradicts an int8 / float8 cache is refused.

    ``kv_cache``: vLLM's per-layer tensor, logical shape [num_blocks, Hkv, block_size,
    2 (D + 4)] of a 1-byte dtype, any physical order with the last dim contiguous; each (slot,
    head) cell holds ``[K row: D codes | K scale: fp32 | V row: D codes | V scale: fp32]``
    (vLLM 0.34's layout, read by its Triton attention as ``float(stored) * scale``). Returns
    the rows [num_blocks, block_size, Hkv, D] as ``dtype`` and the float32 scales
    [num_blocks, block_size, Hkv], views into ``kv_cache`` (no copy)."""
    tensor_arg("kv_cache", kv_cache, 4, (torch.uint8, torch.int8, torch.float8_e4m3fn))
    if dtype is None:
        dtype = torch.float8_e4m3fn if kv_cache.dtype == torch.uint8 else kv_cache.dtype
    if dtype not in (torch.float8_e4m3fn, torch.int8):
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.int8, got {dtype}")
    if kv_cache.dtype != torch.uint8 and dtype != kv_cache.dtype:
        raise ValueError(f"dtype {dtype_name(dtype)} contradicts kv_cache's own dtype "
                         f"{dtype_name(kv_cache.dtype)} (a cache's codes are read as its dtype)")
    d = head_count("head_size", head_size)
    if d % 4 or kv_cache.shape[-1] != 2 * (d + 4):
        raise ValueError(f"kv_cache must have shape [num_blocks, Hkv, block_size, 2 (head_size "
                         f"+ 4)] = [.., {2 * (d + 4)}] with head_size a multiple of 4, got "
                         f"{list(kv_cache.shape)} and head_size {head_size}")
    cell = kv_cache.view(torch.uint8).transpose(1, 2)  # [blocks, slots, Hkv, 2 (D + 4)]
    try:
        words = cell.view(torch.float32)  # the same cells as 4-byte words
    except RuntimeError as e:
        raise ValueError(f"kv_cache's cells must be contiguous and 4-byte aligned (as vLLM "
                         f"allocates them): strides {list(kv_cache.stride())}, offset "
                         f"{kv_cache.storage_offset()}") from e
    return (cell[..., :d].view(dtype), cell[..., d + 4:2 * d + 4].view(dtype),
            words[..., d // 4], words[..., (2 * d + 4) // 4])


def fused_qkv_norm_rope_paged(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                              positions, key_cache, value_cache, slot_mapping, q_norm_weight,
                              k_norm_weight, inv_freq, rms_norm_eps, **kwargs):
    """:func:`fused_qk_norm_rope_paged` on a packed projection output ``qkv``
    [T, (Hq + 2 Hkv) * D] (D from ``q_norm_weight``); same keywords and returns."""
    tensor_arg("qkv", qkv, 2, ACTIVATION_DTYPES)
    tensor_arg("q_norm_weight", q_norm_weight, 1, ACTIVATION_DTYPES)
    d = q_norm_weight.shape[0]
    if d < 1:  # head_dim is not an argument here: q_norm_weight's length gives it
        raise ValueError(f"q_norm_weight must have shape [D] with D >= 1, the head_dim qkv's "
                         f"heads are split by, got {list(q_norm_weight.shape)}")
    q, k, v = _split(qkv, num_q_heads, num_kv_heads, d, "D, the length of q_norm_weight")
    return fused_qk_norm_rope_paged(q, k, v, positions, key_cache, value_cache, slot_mapping,
                                    q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps,
                                    **kwargs)


def rope_cos_sin(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    *,
    cos_sin_scale: float = 1.0,
    mrope_section: tuple[int, int, int] | None = None,
    mrope_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary table a NeoX-style HF rotary embedding returns, in one launch: the cos/sin
    the op computes in-kernel for the same positions, bit for bit (docs/spec.md §1,
    step 2).

    For callers that must also hand cos/sin to code other than the op (the HF integration's
    rotary embedding, in eager mode; docs/design.md, "The rotary table"). Not traceable: under
    ``torch.compile`` compute the table with torch ops.

    Args:
        position_ids: [B, S] int32/int64 positions, any strides (expanded views too). With
            ``mrope_section``: [3, B, S] streams (temporal, height, width), or [B, S] for all
            three.
        inv_freq: [R/2] inverse frequencies (float32, bf16 or fp16, read as float32), on the
            device of ``position_ids``.
        dtype: of the tables: bfloat16, float16 or float32.
        cos_sin_scale: multiplies cos and sin in fp32 before their rounding (HF's
            ``attention_scaling``).
        mrope_section, mrope_interleaved: as the op's (per frequency, the stream whose
            position it takes).

    Returns:
        ``(cos, sin)``, each [B, S, R] contiguous of ``dtype``, its two halves equal:
        ``round(f(float32(position) * inv_freq[i]) * cos_sin_scale)`` at ``[..., i]`` and
        ``[..., i + R/2]`` (f = cos, sin; libdevice on a GPU, as torch's own ``cos``/``sin``).
    """
    if type(mrope_section) is list:
        mrope_section = tuple(mrope_section)
    cos = None
    if (type(position_ids) is torch.Tensor and type(inv_freq) is torch.Tensor and
            position_ids.dim() in (2, 3) and inv_freq.dim() == 1 and dtype in TABLE_DTYPES and
            not torch.compiler.is_compiling()):
        cos, sin = _tables(position_ids, inv_freq, dtype)
        if type(cos_sin_scale) is float and (mrope_section is None or all(
                type(x) is int for x in mrope_section)) and type(mrope_interleaved) is bool and (
                COS_SIN_LAUNCHER.fast_call(
                    ("cos_sin", cos_sin_scale, mrope_section, mrope_interleaved),
                    (position_ids, inv_freq, cos, sin), (), ()) is not None):
            return cos, sin
    opts = check_cos_sin(position_ids, inv_freq, dtype, Options(
        cos_sin_scale=cos_sin_scale, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved))
    if cos is None:  # (the fast path's tables serve here too: their shape passed these checks)
        cos, sin = _tables(position_ids, inv_freq, dtype)
    launched = launch_cos_sin(position_ids, inv_freq, cos, sin, opts)
    key = ("cos_sin", opts.cos_sin_scale, opts.mrope_section, opts.mrope_interleaved)
    COS_SIN_LAUNCHER.remember(key, (position_ids, inv_freq, cos, sin), (), launched,
                              position_ids.get_device())
    return cos, sin


def _tables(position_ids, inv_freq, dtype):
    """Fresh cos and sin tables, [B, S, R] contiguous."""
    shape = (*position_ids.shape[-2:], 2 * inv_freq.shape[0])
    return (torch.empty(shape, dtype=dtype, device=position_ids.device),
            torch.empty(shape, dtype=dtype, device=position_ids.device))
