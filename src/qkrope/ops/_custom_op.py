"""Registering an op as a PyTorch custom op for ``torch.compile``, written once for every op.

:func:`custom_op` registers a destination-passing op: the caller provides every output, the op
mutates them (and the caches) and returns nothing, so ``torch.compile`` sees exactly which
tensors are written, with no functionalisation copy of the caches and nothing for the fake to
allocate. It returns the callable the public functions use: the registered op while
``torch.compile`` traces, the body itself in eager calls (the dispatcher adds host time that an
eager call need not pay).

The op is defined with ``torch.library.Library`` and one ``CompositeExplicitAutograd`` kernel,
not with ``torch.library.custom_op``: inside a compiled graph every call goes through the
dispatcher, and ``custom_op``'s Python autograd and in-place/view layers cost ~420 µs per
call of the op on an H200 host, where the plain definition costs what a registered op that
only adds one does (docs/design.md, "Compile route"). What those layers did is done where it
is cheap: the public functions refuse inputs that autograd would record (at trace time under
``torch.compile``), and the op's body bumps the version counters of what it writes.

An op that launches through a :class:`~qkrope.ops._launch.KernelLauncher` (``launcher=``) also
gets a twin, ``<name>_checked``, with the same schema and body: once the native helpers are
built, the launcher registers a C++ kernel for the op on CUDA that launches the plans of calls
it has seen without entering Python, and hands every other call to the twin
(``csrc/op_route.cpp``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["custom_op"]

_LIBRARY = torch.library.Library("qkrope", "FRAGMENT")


def custom_op(name: str, body: Callable, mutates_args: tuple[str, ...],
              launcher=None, fake: Callable | None = None,
              eager: Callable | None = None) -> Callable:
    """Register ``body`` (a fully annotated function returning None) as
    ``torch.ops.qkrope.<name>`` with ``fake`` (``body``'s arguments, returns None; runs once
    per call site when torch.compile traces it, on fake tensors: the place for checks of
    shapes, dtypes and devices, which then cost the compiled graph nothing) or a fake that
    does nothing; return a function with
    ``body``'s arguments that runs ``body`` directly when eager and the registered op while
    compiling. ``mutates_args``: the arguments ``body`` writes. ``launcher``: the
    ``KernelLauncher`` whose plans ``body`` remembers (under the options string, its last
    argument); the op's schema is then the launcher's pointer arguments, its scalars, and that
    string, and the launcher serves the op natively (module docstring). ``eager``: what the
    returned function runs when eager, where that differs from ``body`` (the public functions
    checked the arguments that ``body``, reached directly through the dispatcher, checks)."""

    schema = torch.library.infer_schema(body, mutates_args=mutates_args)
    for op in (name, name + "_checked") if launcher is not None else (name,):
        _LIBRARY.define(op + schema)
        _LIBRARY.impl(op, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"qkrope::{name}", fake or (lambda *args, **kwargs: None),
                                lib=_LIBRARY)
    if launcher is not None:
        launcher.serve(f"qkrope::{name}", f"qkrope::{name}_checked")
    dispatched = getattr(torch.ops.qkrope, name).default

    def call(*args):
        if torch.compiler.is_compiling():
            return dispatched(*args)
        return run(*args)

    run = eager or body
    call.__name__ = call.__qualname__ = name
    call.__doc__ = body.__doc__
    return call
