"""``torch.ops.qkrope.qknorm_rope``: the op as a PyTorch custom op, for ``torch.compile``.

Its body is what every eager launch runs: the native fast path for a signature it has seen
(``KernelLauncher.fast_call``: no Python checks, one ``cuLaunchKernel``), else the overlap check
and the checked launch, which keeps a plan for that signature; a call that did not come through
a public function (the registered op called directly) gets their checks first, once per
signature (docs/design.md, "Eager bypass"). Inside a compiled graph the
arguments were checked when the graph was traced; there the dispatcher runs the op's C++ kernel
once the native helpers are built (``csrc/op_route.cpp``: the same plans, no Python), which
hands a call without a plan to this body as ``qkrope::qknorm_rope_checked`` (docs/design.md,
"Compile route"). One direction: public function -> checks -> this op -> the launch. Calls
with ``append=True``, whose kernel also advances the running length it is given, take
``torch.ops.qkrope.qknorm_rope_append``: the same body, a schema that declares that write.
"""

from __future__ import annotations

import ast
import functools
import inspect

import torch

from .._custom_op import custom_op
from .checks import (
    Options, check_bhsd, check_options, check_out, check_overlap, check_paged, check_scales,
    refuse_autograd,
)
from .launcher import APPEND_LAUNCHER, LAUNCHER, launch

__all__ = ["qknorm_rope", "qknorm_rope_append", "options_key", "op_options"]


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
    q_scale: torch.Tensor | None,
    k_scale_cache: torch.Tensor | None,
    v_scale_cache: torch.Tensor | None,
    query_out: torch.Tensor,
    key_out: torch.Tensor,
    rms_norm_eps: float,
    options: str,
) -> None:
    """The registered op's kernel: writes ``query_out``, ``key_out`` and the cache rows, and
    bumps their version counters; ``options``: the canonical options as one string
    (:func:`options_key`). A call that reaches it (``torch.ops.qkrope.qknorm_rope`` called
    directly in eager, or the native op route handing over a call it has no plan for) gets the
    public functions' checks before a launch of a signature not seen yet: a direct caller's
    wrong shape is refused, never launched out of bounds."""
    _run((query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
          k_norm_weight, inv_freq, k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache),
         query_out, key_out, rms_norm_eps, options, checked=False, append=False)


def _qknorm_rope_append(*args) -> None:
    """:func:`_qknorm_rope` for ``append=True`` options, whose kernel also advances ``slots``
    (the cache's running length): a schema of its own declares that write, so torch.compile
    orders the length's readers around it (on :func:`_qknorm_rope`'s, ``slots`` would be a
    written input for every call, and a CUDA-graph tree skips graphs that write a non-static
    input, e.g. a serving engine's slot mapping)."""
    _run(args[:15], *args[15:], checked=False, append=True)


_qknorm_rope_append.__signature__ = inspect.signature(_qknorm_rope)  # the same arguments


def _checked_by_caller(*args) -> None:
    """The op's body for the public functions' eager calls, whose arguments they checked."""
    _run(args[:15], *args[15:], checked=True, append=None)


#: What the checks of a direct call judge (types, shapes, strides, dtypes, devices, autograd,
#: the options and epsilon) for calls already checked: off the native route a compiled graph
#: calls the op through the dispatcher at every step, and this key costs a third of the checks
#: (docs/design.md, "Eager bypass").
_CHECKED: dict = {}


def _run(inputs: tuple, query_out, key_out, rms_norm_eps: float, options: str,
         checked: bool, append: bool | None) -> None:
    """``append``: whether the op called is the one for ``append=True`` options (None: the
    public functions' own eager call, whose options say it)."""
    opts = _options(options)
    if append is not None:
        _one_kind(opts, append, options)
    launcher = APPEND_LAUNCHER if opts.append else LAUNCHER
    if launcher.fast_call(opts, inputs, (query_out, key_out), (rms_norm_eps,)) is not None:
        return
    k_scale, v_scale, q_scale, k_scale_cache, v_scale_cache = inputs[10:]
    if not checked:
        key = (options, rms_norm_eps, torch.is_grad_enabled(), *(
            None if t is None else
            (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.is_neg())
            for t in (*inputs, query_out, key_out)))
        if key not in _CHECKED:
            _traced_checks(*inputs, query_out, key_out, rms_norm_eps, options, opts.append)
            refuse_autograd(opts.layout, (*inputs[:10], query_out, key_out),
                            **dict(zip(("k_scale", "v_scale", "q_scale", "k_scale_cache",
                                        "v_scale_cache"), inputs[10:])))
            if len(_CHECKED) >= 256:
                _CHECKED.clear()
            _CHECKED[key] = None
    # The fast path runs the overlap rules natively; a checked launch runs them here.
    check_overlap(opts.layout, (*inputs[:10], query_out, key_out), k_scale, v_scale, q_scale,
                  k_scale_cache, v_scale_cache, append=opts.append)
    launched = launch(*inputs, query_out, key_out, rms_norm_eps, opts)
    launcher.remember(opts, inputs, (query_out, key_out), launched, inputs[0].get_device(),
                      op_options=options)
    torch._C._increment_version(tuple(t for t in (inputs[4], inputs[5], k_scale_cache,
                                                  v_scale_cache, query_out, key_out,
                                                  inputs[6] if opts.append else None)
                                      if t is not None))


def _traced_checks(query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
                   k_norm_weight, inv_freq, k_scale, v_scale, q_scale, k_scale_cache,
                   v_scale_cache, query_out, key_out, rms_norm_eps, options,
                   append: bool = False) -> None:
    """The op's fake: the public function's checks of shapes, dtypes and devices (those of the
    entry point ``options`` names), run when torch.compile traces a call, on fake tensors. A
    call through a public function was checked already; a caller that compiles a direct call
    of the op (the HF integration's layers: docs/design.md, "Compile route") is checked here,
    where the checks add no guard to the compiled code. What needs memory or values (overlap,
    rows, scale values) is judged when the call runs, as in every call."""
    opts = _options(options)
    _one_kind(opts, append, options)
    check = check_bhsd if opts.layout == "bhsd" else check_paged
    check(query, key, value, positions, key_cache, value_cache, slots, q_norm_weight,
          k_norm_weight, inv_freq, rms_norm_eps, opts)
    check_out("query_out", query_out, query)
    check_out("key_out", key_out, key)
    check_scales(query, key, key_cache, value_cache, query_out, key_out,
                 (k_scale, v_scale, q_scale), (k_scale_cache, v_scale_cache))


def _one_kind(opts: Options, append: bool, options: str) -> None:
    """Each registered op takes the options of its own kind of call only: the append op's
    schema declares the running length's write, the other's does not."""
    if opts.append is not append:
        raise ValueError(f"qkrope::qknorm_rope{'_append' if append else ''} takes options "
                         f"{'with' if append else 'without'} append=True, got {options}")


def op_options(opts: Options, head_dim: int) -> str:
    """The op's ``options`` argument for the public options ``opts`` (checked, canonical: the
    string a public function passes for them)."""
    return options_key(check_options(opts, head_dim))


def options_key(opts: Options) -> str:
    """Canonical options as the registered op's one ``options`` argument: every call through
    the dispatcher boxes each argument, so the nine static options travel as one string
    (docs/design.md, "Compile route")."""
    return repr(tuple(opts))


@functools.lru_cache(maxsize=256)
def _options(key: str) -> Options:
    return Options(*ast.literal_eval(key))


_MUTATED = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "query_out",
            "key_out")
qknorm_rope = custom_op("qknorm_rope", _qknorm_rope, mutates_args=_MUTATED, launcher=LAUNCHER,
                        fake=_traced_checks, eager=_checked_by_caller)
qknorm_rope_append = custom_op("qknorm_rope_append", _qknorm_rope_append,
                               mutates_args=(*_MUTATED, "slots"), launcher=APPEND_LAUNCHER,
                               fake=functools.partial(_traced_checks, append=True),
                               eager=_checked_by_caller)
