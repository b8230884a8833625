"""``torch.ops.qkrope.qknorm_rope``: the op as a PyTorch custom op, for ``torch.compile``.

Its body is what every launch runs, eager or inside a compiled graph: the native fast path for
a signature it has seen (``KernelLauncher.fast_call``: no Python checks, one ``cuLaunchKernel``),
else the checked launch, which keeps a plan for that signature. Inside a compiled graph the
arguments were checked when the graph was traced, so each call costs what an eager fast-path
call does plus the dispatcher (docs/design.md, "The compile route"). One direction: public
function -> checks -> this op -> the launch.
"""

from __future__ import annotations

import torch

from .._custom_op import custom_op
from .launcher import LAUNCHER, Options, launch

__all__ = ["qknorm_rope"]


def _qknorm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    query_out: torch.Tensor,
    key_out: torch.Tensor,
    rms_norm_eps: float,
    layout: str,
    rotary_style: str,
    rotary_dim: int,
    norm_weight_offset: float,
    norm_rounding: str,
    cos_sin_scale: float,
    mrope_section: list[int] | None,
    mrope_interleaved: bool,
) -> None:
    """Checked arguments of either entry point, options in canonical form; writes
    ``query_out``, ``key_out`` and the cache rows, and bumps their version counters."""
    opts = Options(layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                   cos_sin_scale, None if mrope_section is None else tuple(mrope_section),
                   mrope_interleaved)
    inputs = (query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
              k_norm_weight, inv_freq, k_scale, v_scale)
    if LAUNCHER.fast_call(opts, inputs, query, key, query_out, key_out, rms_norm_eps) is None:
        signature = LAUNCHER.signature(opts, (*inputs, query_out, key_out))
        result = launch(*inputs, query_out, key_out, rms_norm_eps, opts)
        LAUNCHER.remember(None if signature is None else signature[0], *result,
                          query.get_device())
        torch._C._increment_version((key_cache, value_cache, query_out, key_out))


qknorm_rope = custom_op("qknorm_rope", _qknorm_rope,
                        mutates_args=("key_cache", "value_cache", "query_out", "key_out"))
