"""Memory-overlap checks between the tensors of a call, for every op.

A kernel that writes one tensor while reading (or writing) another that shares memory with it
gives wrong results that depend on scheduling. These checks compare what the tensors address,
not which storage they come from: views of one allocation that address disjoint elements (vLLM's
packed ``[num_blocks, Hkv, block_size, 2 D]`` K/V cache, the q/k/v views of a packed projection)
are fine; a view whose elements are also reached through another is not.

The same rules run natively on the fast path (``csrc/fast_path.cpp``, ``overlap``); the two are
tested against each other and against brute-force enumeration (tests/test_overlap.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["extent", "may_overlap", "self_overlaps", "check_disjoint"]

# Search nodes allowed before "may overlap" is assumed (layouts that need more are exotic).
_SEARCH_BUDGET = 4096


def extent(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)`` byte addresses ``t`` can touch (``(0, 0)`` for an empty tensor)."""
    if t.numel() == 0:
        return 0, 0
    lo = hi = t.data_ptr()
    e = t.element_size()
    for n, s in zip(t.shape, t.stride()):
        step = (n - 1) * s * e
        if step < 0:
            lo += step
        else:
            hi += step
    return lo, hi + e


def _same_lattice_hit(delta: int, dims: list[tuple[int, int, int]]) -> bool:
    """Whether ``delta = sum j_k s_k`` for integers ``lo_k <= j_k <= hi_k`` (``dims``:
    (stride, lo, hi), strides > 0 sorted descending); True also when the search runs out of
    budget (the caller then assumes an overlap)."""
    # Bound of what the smaller strides can still add, per level.
    reach = [0] * (len(dims) + 1)
    for k in range(len(dims) - 1, -1, -1):
        s, lo, hi = dims[k]
        reach[k] = reach[k + 1] + s * max(-lo, hi)
    budget = [_SEARCH_BUDGET]

    def search(k: int, rest: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if k == len(dims):
            return rest == 0
        s, lo, hi = dims[k]
        r = reach[k + 1]
        # j with |rest - j s| <= r: ceil((rest - r) / s) .. floor((rest + r) / s)
        first = max(lo, -((r - rest) // s))
        last = min(hi, (rest + r) // s)
        return any(search(k + 1, rest - j * s) for j in range(first, last + 1))

    return search(0, delta)


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` address a common byte, for any shapes, strides and element sizes
    (e.g. vLLM's per-token-head cache: FP8 rows and the float32 scales between them, interleaved
    views of one allocation). Exact: a byte of ``a`` is ``a_ptr + sum i_k s_k e_a + u`` (``u <
    e_a``), one of ``b`` likewise, so they meet where ``b_ptr - a_ptr`` is a sum of the strides
    (in bytes) of both, times bounded integers, plus ``u - v``; "may" only when the search runs
    out of budget."""
    a_lo, a_hi = extent(a)
    b_lo, b_hi = extent(b)
    if a_lo >= b_hi or b_lo >= a_hi or a_lo == a_hi or b_lo == b_hi:
        return False
    ea, eb = a.element_size(), b.element_size()
    ranges: dict[int, tuple[int, int]] = {}  # byte stride -> range of its integer factor

    def add(stride: int, lo: int, hi: int) -> None:
        old_lo, old_hi = ranges.get(stride, (0, 0))
        ranges[stride] = (old_lo + lo, old_hi + hi)  # equal strides add their ranges

    for sign, t, e in ((1, a, ea), (-1, b, eb)):
        for n, st in zip(t.shape, t.stride()):
            if st == 0 or n == 1:
                continue
            j = (0, n - 1) if st * sign > 0 else (-(n - 1), 0)
            add(abs(st) * e, *j)
    add(1, -(eb - 1), ea - 1)  # u - v: the bytes within an element
    dims = sorted(((st, lo, hi) for st, (lo, hi) in ranges.items()), key=lambda d: -d[0])
    return _same_lattice_hit(b.data_ptr() - a.data_ptr(), dims)


def self_overlaps(t: torch.Tensor) -> bool:
    """Whether two indices of ``t`` may address one element (stride 0 of an expanded view, or
    strides that interleave): sorted by stride, each stride must exceed the span of the
    smaller ones."""
    span = 0
    for s, n in sorted((abs(s), n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if s <= span:
            return True
        span += (n - 1) * s
    return False


def check_disjoint(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor | None],
                   identical_ok: Iterable[tuple[str, str]] = ()) -> None:
    """Raise ``ValueError`` naming both arguments if a written tensor may share memory with any
    other tensor of the call (written or read) or with itself. ``identical_ok``: (written,
    read) pairs that may be the very same view (same address, shape and strides: an in-place
    update where each element is read before the program that owns it writes it)."""
    ok = set(identical_ok)
    tensors = {**{n: t for n, t in read.items() if t is not None}, **written}
    for name, w in written.items():
        if self_overlaps(w):
            raise ValueError(f"{name} has elements that overlap each other (e.g. an expanded "
                             f"view with stride 0: shape {list(w.shape)}, strides "
                             f"{list(w.stride())}); outputs and caches need distinct elements")
    names = list(tensors)
    # Each extent once: most pairs are apart (separate allocations), and the search below
    # starts from the same test (the checked path runs this on every call).
    spans = {n: extent(t) for n, t in tensors.items()}
    for i, name in enumerate(names):
        if name not in written:
            continue
        w = tensors[name]
        w_lo, w_hi = spans[name]
        for other in names:
            if other == name or (other in written and names.index(other) < i):
                continue
            t_lo, t_hi = spans[other]
            if w_lo >= t_hi or t_lo >= w_hi or w_lo == w_hi or t_lo == t_hi:
                continue
            t = tensors[other]
            if (name, other) in ok or (other, name) in ok:
                if (w.data_ptr() == t.data_ptr() and w.shape == t.shape
                        and w.stride() == t.stride() and w.dtype == t.dtype):
                    continue
            if may_overlap(w, t):
                allowed = [f"{a} may be {b} itself" for a, b in ok if name in (a, b)]
                hint = (f" ({'; '.join(allowed)}: the same view, no other overlap)"
                        if allowed else "")
                raise ValueError(f"{name} overlaps {other} in memory: the kernel would read "
                                 f"data it has already overwritten{hint}")
