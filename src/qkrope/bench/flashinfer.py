"""FlashInfer's fused QK RMSNorm + RoPE + paged K/V append as a ``qkrope bench`` peer (paged
layout): ``cake_fused_qk_rmsnorm_rope_append_paged_kv_cache`` (FlashInfer 0.7.x, SM90+, head_dim
128, 64/8 or 8/1 heads: ``--layout paged --model qwen3-32b``).

FlashInfer takes its own input forms: one packed ``[T, (Hq + 2 Hkv) * D]`` bf16 projection, an
fp32 ``[positions, D]`` cos|sin table, fp32 norm weights, and per request a sequence length,
a query range and a row of a page table, from which it derives each row's position and cache
slot. :func:`flashinfer_inputs` builds them from the bench's paged inputs (requests are runs of
consecutive positions; a slot must sit at its position's offset in a 16-token page, as the
bench's inputs do) and checks that FlashInfer's rule gives back exactly the bench's positions
and slots. The adapter builds them once per input set, on its first call (the correctness
check), as an engine builds them once per step for every layer; the timed calls are the op
alone, with ``clear_unused_last_page_rows=False`` (the same work as qkrope's op).

FlashInfer returns the rotated Q and writes K and V into the cache; it has no rotated-K output,
so the adapter returns None there and the bench checks K through the cache rows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..suite import PAGED_BLOCK_SIZE

#: The head configurations FlashInfer 0.7.x ships for this op, at head_dim 128.
HEADS = ((64, 8), (8, 1))
HEAD_DIM = 128


def unavailable() -> str | None:
    """Why the peer cannot run here, or None (cheap: FlashInfer is not imported)."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed"
    if not torch.cuda.is_available():
        return "FlashInfer's op needs a CUDA GPU (SM90+)"
    return None


@dataclass(frozen=True)
class FlashInferInputs:
    qkv: torch.Tensor            # [T, (Hq + 2 Hkv) * D] bf16, contiguous
    cos_sin: torch.Tensor        # [max position + 1, D] fp32: cos | sin of each frequency
    seq_lens: torch.Tensor       # [R] int32: tokens of request r in the cache after the call
    q_indptr: torch.Tensor       # [R + 1] int32: request r's rows are q_indptr[r]:q_indptr[r+1]
    page_indices: torch.Tensor   # [R, pages] int32 page table
    q_norm_weight: torch.Tensor  # [D] fp32
    k_norm_weight: torch.Tensor  # [D] fp32


def flashinfer_inputs(query, key, value, positions, slot_mapping, q_norm_weight, k_norm_weight,
                      inv_freq, page_size: int = PAGED_BLOCK_SIZE) -> FlashInferInputs:
    """FlashInfer's input forms for the bench's paged inputs (one host sync; see the module
    docstring). Raises ValueError when FlashInfer's rules cannot express them."""
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if D != HEAD_DIM or (Hq, Hkv) not in HEADS:
        raise ValueError(f"FlashInfer's fused op ships head_dim {HEAD_DIM} with "
                         f"{' or '.join(f'{q}/{k}' for q, k in HEADS)} heads, not {Hq}/{Hkv}/{D} "
                         f"(--model qwen3-32b is 64/8/128)")
    if query.dtype != torch.bfloat16:
        raise ValueError(f"FlashInfer's fused op takes bf16, not {query.dtype}")
    dev = query.device
    pos, slots = positions.to(torch.int64), slot_mapping.to(torch.int64)
    # A request per run of consecutive positions whose rows share their pages (a prefill is
    # one; a decode batch one per row, also where two sequences sit at adjacent positions).
    starts = torch.ones(T, dtype=torch.bool, device=dev)
    same_page = pos[1:] // page_size == pos[:-1] // page_size
    starts[1:] = (pos[1:] != pos[:-1] + 1) | (same_page & (slots[1:] != slots[:-1] + 1))
    first = starts.nonzero().flatten()
    q_indptr = torch.cat((first, torch.tensor([T], device=dev)))
    req = torch.cumsum(starts.to(torch.int64), 0) - 1
    seq_lens = pos[q_indptr[1:] - 1] + 1
    pages = (int(seq_lens.max()) + page_size - 1) // page_size
    page_indices = torch.zeros(len(first), pages, dtype=torch.int64, device=dev)
    page_indices[req, pos // page_size] = slots // page_size
    # FlashInfer's rule (row r of request b: position r + seq_lens[b] - q_indptr[b + 1], slot from
    # the page table) must give back exactly the bench's positions and slots.
    rows = torch.arange(T, device=dev)
    fi_pos = rows + seq_lens[req] - q_indptr[1:][req]
    fi_slot = page_indices[req, fi_pos // page_size] * page_size + fi_pos % page_size
    if not (torch.equal(fi_pos, pos) and torch.equal(fi_slot, slots)):
        raise ValueError("FlashInfer derives each row's cache slot from its position and a page "
                         f"table of {page_size}-token pages; these slots do not follow one")
    angles = torch.arange(int(seq_lens.max()), device=dev, dtype=torch.float32)[:, None] \
        * inv_freq.float()[None, :]
    qkv = torch.cat((query.reshape(T, -1), key.reshape(T, -1), value.reshape(T, -1)), dim=1)
    return FlashInferInputs(
        qkv=qkv.contiguous(), cos_sin=torch.cat((angles.cos(), angles.sin()), 1).contiguous(),
        seq_lens=seq_lens.to(torch.int32), q_indptr=q_indptr.to(torch.int32),
        page_indices=page_indices.to(torch.int32).contiguous(),
        q_norm_weight=q_norm_weight.float().contiguous(),
        k_norm_weight=k_norm_weight.float().contiguous())


class FlashInferPaged:
    """The bench's paged calling convention around FlashInfer's op ``op``."""

    def __init__(self, op):
        self.op = op
        self._args: tuple = ()
        self._versions: tuple = ()
        self._inputs: FlashInferInputs | None = None

    def __call__(self, query, key, value, positions, key_cache, value_cache, slot_mapping,
                 q_norm_weight, k_norm_weight, inv_freq, rms_norm_eps):
        # Built once per input set: the same tensor objects (kept alive here, so never a new
        # tensor at a reused address), none written in place since (~1 µs of host time).
        args = (query, key, value, positions, slot_mapping, q_norm_weight, k_norm_weight, inv_freq)
        versions = tuple(t._version for t in args)
        if (len(args) != len(self._args) or versions != self._versions
                or any(a is not b for a, b in zip(args, self._args))):
            self._inputs = flashinfer_inputs(*args, page_size=key_cache.shape[1])
            self._args, self._versions = args, versions
        fi = self._inputs
        q_out = self.op(fi.qkv, fi.cos_sin, fi.seq_lens, fi.q_indptr, fi.page_indices, key_cache,
                        value_cache, num_q_heads=query.shape[1], num_kv_heads=key.shape[1],
                        qk_norm_policy=2, q_norm_weight=fi.q_norm_weight,
                        k_norm_weight=fi.k_norm_weight, eps=rms_norm_eps,
                        clear_unused_last_page_rows=False)
        return q_out.view(query.shape), None, key_cache, value_cache


def build():
    """The adapter around the installed FlashInfer's op; ImportError when it cannot run."""
    if (why := unavailable()) is not None:
        raise ImportError(why)
    from flashinfer.cake_fused_qk_rope_append import (
        cake_fused_qk_rmsnorm_rope_append_paged_kv_cache as op,
    )
    return FlashInferPaged(op)
