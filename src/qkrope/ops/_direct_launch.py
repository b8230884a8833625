"""Cached direct launches of compiled Triton kernels: the eager fast path of every op.

Triton's own launch path re-binds and re-specialises every argument on every call (~100 µs per
call for the ops' 50-60 arguments on the H200 test host). An op that has checked a call and
launched it through Triton remembers the compiled kernel under the call's *signature*: every
tensor's shape, strides, dtype, device and 16-byte alignment plus the op's static options.
Everything Triton specialises on (integer values equal to 1 or divisible by 16, pointer
alignment, dtypes) and everything the op's checks look at is a function of that signature, so a
later call with the same signature skips both and launches the compiled kernel directly.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton

from .._interpret import interpreting
from . import _native

__all__ = ["Plan", "PlanCache", "signature", "new_outputs", "outputs", "param_kinds",
           "fast_path_ok", "device_of"]

# The raw handle of the current stream, as Triton's own launcher gets it (a tenth of the cost of
# building a torch.cuda.Stream object per call); the public route where it is missing.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                     lambda index: torch.cuda.current_stream(index).cuda_stream)
# torch.cuda.current_device() minus its lazy-init check: a plan exists only after a launch.
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


def device_of(t: torch.Tensor):
    """Context that makes ``t``'s GPU current (Triton launches on the current device), or a
    no-op off CUDA."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fast_path_ok() -> bool:
    """Direct launches skip Triton's launch hooks (e.g. its profiler), so they are used only
    when none is installed (Triton 3.6 keeps an empty HookChain there rather than None). (Plans
    are never made in the interpreter: :meth:`PlanCache.remember`.)"""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", True)


def signature(options: tuple, tensors: Sequence, addresses: list) -> tuple | None:
    """``options`` plus (shape, strides, dtype, device, 16 B aligned) of each tensor (None kept
    as None); None when an argument is not a tensor (the checked path then raises its error).
    Appends each tensor's address (or None) to ``addresses``: the direct launch passes those.

    Read natively (:mod:`._native`, one C++ call) once that helper is built, else in Python.
    """
    native = _native.signature_fn()
    if native is not None:
        packed = native(*tensors)
        if packed is None:  # a non-tensor, a Tensor subclass, a tensor without strides
            return None
        addresses += packed[1]
        return options, packed[0]
    key = [options]
    try:
        for t in tensors:
            if t is None:
                key.append(None)
                addresses.append(None)
            else:
                p = t.data_ptr()
                addresses.append(p)
                key += (t.shape, t.stride(), t.dtype, t.get_device(), p % 16 == 0)
    except AttributeError:
        return None
    return tuple(key)


def new_outputs(query: torch.Tensor, key: torch.Tensor, query_out, key_out) -> tuple:
    """``(query_out, key_out)``: each output given is returned as is, each one not given (None)
    is allocated contiguous like ``query``/``key``. Plain torch calls: traceable (the checked
    path runs under torch.compile too)."""
    if query_out is None:
        query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if key_out is None:
        key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    return query_out, key_out


def outputs(query: torch.Tensor, key: torch.Tensor, query_out, key_out) -> tuple:
    """:func:`new_outputs` plus both outputs' addresses, for a direct launch: natively
    (:mod:`._native`, one C++ call, never traced) once that helper is built, else in Python."""
    native = _native.outputs_fn()
    if native is not None:
        return native(query, key, query_out, key_out)
    query_out, key_out = new_outputs(query, key, query_out, key_out)
    return query_out, key_out, query_out.data_ptr(), key_out.data_ptr()


class Plan(NamedTuple):
    """A compiled kernel bound to one signature: launch it with the per-call arguments (the
    tensors' addresses, then the runtime scalars before ``tail``)."""

    run: Callable     # the native launch, Triton's C launch function, or CompiledKernel.run
    head: tuple       # the arguments before the stream: the native plan, or Triton's grid
    middle: tuple     # the arguments between the stream and the kernel's own
    tail: tuple       # the remaining launch arguments, constexprs included (Triton only)
    device_index: int

    def launch(self, addresses: list, *scalars) -> None:
        # Raw addresses, not tensors: for a tensor Triton's launcher calls data_ptr() and asks
        # the driver (cuPointerGetAttribute) where it lives; the signature fixed the device.
        if current_device() == self.device_index:
            self.run(*self.head, raw_stream(self.device_index), *self.middle, *addresses,
                     *scalars, *self.tail)
        else:  # a launch goes to the current device: make the tensors' device current
            with torch.cuda.device(self.device_index):
                self.run(*self.head, raw_stream(self.device_index), *self.middle, *addresses,
                         *scalars, *self.tail)


# Triton scalar type -> the native launcher's parameter kind (csrc/fast_path.cpp, kind_size).
_KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "B", "u8": "B",
          "u16": "H", "u32": "I", "u64": "L", "fp32": "f", "f32": "f", "fp64": "d",
          "constexpr": "c"}


def param_kinds(signature: dict) -> str | None:
    """The native launcher's kinds for a kernel compiled by Triton 3.6 with ``signature``
    (``CompiledKernel.src.signature``: argument name -> type, in argument order, constexprs
    included): one kind per argument, then two null pointers for the global and profile
    scratch buffers Triton appends to every kernel. None for types it does not pack (tuples,
    tensor descriptors, fp16/bf16 scalars). The driver checks the result against the kernel's
    own parameter table (``cuFuncGetParamInfo``) before any launch."""
    kinds = []
    for ty in signature.values():
        if isinstance(ty, str) and ty.startswith("*"):
            kinds.append("p")
        elif isinstance(ty, str) and ty in _KINDS:
            kinds.append(_KINDS[ty])
        else:
            return None
    return "".join(kinds) + "pp"


def _native_plan(compiled, grid: tuple, launch_args: tuple, n_head: int, device_index: int):
    """A native launch plan for ``compiled`` (csrc/fast_path.cpp), or None where the native
    helpers are not built, the kernel needs what Triton's launcher adds (scratch memory,
    clusters, cooperative or PDL launches), or the driver's parameter table disagrees."""
    module = _native.module()
    runner, md = getattr(compiled, "run", None), getattr(compiled, "metadata", None)
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if module is None or not isinstance(signature, dict) or len(signature) != len(launch_args):
        return None
    if (getattr(md, "num_ctas", None) != 1 or getattr(runner, "launch_cooperative_grid", 1)
            or getattr(runner, "launch_pdl", 1) or getattr(runner, "global_scratch_size", 1)
            or getattr(runner, "profile_scratch_size", 1)):
        return None
    kinds = param_kinds(signature)
    if kinds is None:
        return None
    return module.make_launch(compiled.function, *grid, 32 * md.num_warps, md.shared,
                              device_index, kinds, (*launch_args, None, None), n_head)


def _bind(compiled, grid: tuple, launch_args: tuple, n_head: int, device_index: int):
    """``(run, head, middle, tail)`` of the cheapest way to launch ``compiled``: the native
    launcher once built; else Triton 3.6's C ``launch`` when the kernel needs no scratch memory
    (that is all the Python ``CudaLauncher.__call__`` adds); else ``compiled.run``."""
    native = _native_plan(compiled, grid, launch_args, n_head, device_index)
    if native is not None:
        return _native.module().launch, (native,), (), ()
    tail = launch_args[n_head:]
    runner = compiled.run
    c_launch = getattr(runner, "launch", None)
    plain = (getattr(runner, "global_scratch_size", 1) == 0
             and getattr(runner, "profile_scratch_size", 1) == 0
             and c_launch is not None
             and not isinstance(c_launch, types.FunctionType))  # not Triton's Python wrapper
    if plain:
        return c_launch, grid, (compiled.function, runner.launch_cooperative_grid,
                                runner.launch_pdl, None, None, compiled.packed_metadata, None,
                                None, None), tail
    return runner, grid, (compiled.function, compiled.packed_metadata, None, None, None), tail


class PlanCache(dict):
    """Signature -> :class:`Plan` for one @triton.jit kernel (bounded)."""

    MAX_PLANS = 4096

    def find(self, key) -> Plan | None:
        """The plan for ``key``; None for no key or an unhashable option (the checked path then
        reports the bad argument)."""
        if key is None:
            return None
        try:
            return self.get(key)
        except TypeError:
            return None

    def remember(self, key, jit_fn, compiled, grid, args: list, meta: dict, n_head: int,
                 device_index: int) -> None:
        """After a launch through Triton (``jit_fn[grid](*args, **meta)`` returned
        ``compiled``), keep it for ``key``; the first ``n_head`` args (tensors, then scalars)
        vary per call."""
        if key is None or interpreting() or not fast_path_ok() or not hasattr(compiled, "run"):
            return
        _native.start_build()  # in the background; later calls use it once built
        try:
            hash(key)
        except TypeError:
            return
        if len(self) >= self.MAX_PLANS:
            self.clear()
        # Constexpr parameters are passed too, in parameter order, after the runtime ones.
        constexprs = (meta[n] for n in jit_fn.arg_names[len(args):])
        grid = (*grid, 1, 1)[:3]  # the launchers take all three grid dimensions
        self[key] = Plan(*_bind(compiled, grid, (*args, *constexprs), n_head, device_index),
                         device_index)
