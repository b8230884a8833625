"""``validate=True``: the value checks of cache rows / slots, a running length and FP8 scale
tensors.

They read tensor values, so they cost a host sync and run only on request. Eagerly they raise
``ValueError`` at once. Under ``torch.compile`` they run as two small custom ops when the
compiled graph runs, raising the same ``ValueError``: a check traced into the graph instead
(``torch._check`` on a data-dependent bool) becomes one of inductor's runtime asserts, whose
message is only its expression ("u0 >= 1"), naming no argument. Each op returns a checked copy
of its tensor that the launch then reads, so the check runs before the kernel and is never
dropped as dead code (an op with no output would be).
"""

from __future__ import annotations

import torch

__all__ = ["check_rows", "check_room", "check_scale", "validated_rows", "validated_scale"]


def check_rows(rows: torch.Tensor, bound: int, name: str) -> None:
    """Every row / slot in ``[0, bound)``, or ``ValueError`` naming ``name`` and a value."""
    # In int64: an int32 tensor compared with a bound of 2**31 or more would wrap the bound.
    r = rows.long()
    ok = (r >= 0) & (r < bound)
    if not bool(ok.all()):  # host sync: only on request
        raise ValueError(f"{name} holds {r.reshape(-1)[~ok.reshape(-1)][0].item()}, outside the "
                         f"cache [0, {bound}) (validate=True raises instead of skipping)")


def check_room(length: torch.Tensor, new_rows: int, bound: int, name: str,
               error: type[Exception] = ValueError) -> None:
    """``append=True``: the running length ``length`` leaves room for ``new_rows`` rows of a
    ``bound``-row cache (0 <= n <= bound - new_rows), or ``error`` naming ``name`` and n."""
    n = int(length.reshape(()))  # host sync on a GPU: only on request
    if not 0 <= n <= bound - new_rows:
        raise error(f"{name} (append=True, the cache's running length) is {n}: {new_rows} new "
                    f"rows do not fit a cache of {bound} rows")


def check_scale(scale: torch.Tensor, name: str) -> None:
    """Every FP8 scale value finite and > 0, or ``ValueError`` naming ``name`` and a value."""
    ok = torch.isfinite(scale) & (scale > 0)
    if not bool(ok.all()):
        raise ValueError(f"{name} holds {scale.reshape(-1)[~ok.reshape(-1)][0].item()}, not "
                         "finite and > 0")


@torch.library.custom_op("qkrope::validated_rows", mutates_args=())
def validated_rows(rows: torch.Tensor, bound: int, name: str) -> torch.Tensor:
    """:func:`check_rows`, then a copy of ``rows`` (the tensor the launch reads)."""
    check_rows(rows, bound, name)
    return rows.clone()


@validated_rows.register_fake
def _(rows, bound, name):
    return torch.empty_like(rows)


@torch.library.custom_op("qkrope::validated_scale", mutates_args=())
def validated_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`check_scale`, then a copy of ``scale`` (the tensor the launch reads)."""
    check_scale(scale, name)
    return scale.clone()


@validated_scale.register_fake
def _(scale, name):
    return torch.empty_like(scale)
