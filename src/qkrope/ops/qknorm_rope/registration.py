"""``torch.ops.qkrope.qknorm_rope``: the op as a PyTorch custom op, for ``torch.compile``.

:func:`custom_op` is written once for every op: it registers a destination-passing op (the
caller provides every output; the op mutates them and the caches and returns nothing, so
``torch.compile`` sees exactly which tensors are written, with no functionalisation copy of the
caches and nothing for the fake to allocate) and returns the callable the public functions use.
That callable goes through the dispatcher only while ``torch.compile`` traces; eager calls run
the body directly, since the dispatcher adds host time to every call
(benchmarks/e2e_qwen3.py measures both routes). One direction: public function -> checks ->
this callable -> the launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .launcher import Options, launch

__all__ = ["custom_op", "qknorm_rope"]


def custom_op(name: str, body: Callable, mutates_args: tuple[str, ...]) -> Callable:
    """Register ``body`` (a fully annotated function) as ``torch.ops.qkrope.<name>`` with a fake
    that does nothing; return a function with ``body``'s arguments that runs ``body`` directly
    when eager (returning what it returns) and the registered op while compiling (None)."""
    op = torch.library.custom_op(f"qkrope::{name}", mutates_args=mutates_args)(
        _returning_none(body))
    op.register_fake(lambda *args, **kwargs: None)
    dispatched = getattr(torch.ops.qkrope, name)

    def call(*args):
        if torch.compiler.is_compiling():
            return dispatched(*args)
        return body(*args)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = body.__doc__
    return call


def _returning_none(body: Callable) -> Callable:
    def op(*args, **kwargs) -> None:
        body(*args, **kwargs)

    op.__name__, op.__doc__ = body.__name__, body.__doc__
    op.__signature__ = _none_signature(body)
    return op


def _none_signature(body: Callable):
    import inspect

    return inspect.signature(body).replace(return_annotation=None)


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
):
    """Checked arguments of either entry point, options in canonical form; writes
    ``query_out``, ``key_out`` and the cache rows."""
    opts = Options(layout, rotary_style, rotary_dim, norm_weight_offset, norm_rounding,
                   cos_sin_scale, None if mrope_section is None else tuple(mrope_section),
                   mrope_interleaved)
    return launch(query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
                  k_norm_weight, inv_freq, k_scale, v_scale, query_out, key_out, rms_norm_eps,
                  opts)


qknorm_rope = custom_op("qknorm_rope", _qknorm_rope,
                        mutates_args=("key_cache", "value_cache", "query_out", "key_out"))
