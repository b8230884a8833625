"""Launching a compiled kernel, for every op: Triton's public launch, and the native fast path.

Two routes, no more:

- **Triton's public launch** (``kernel[grid](**args, **meta)``): every checked call. It binds
  and specialises every argument per call (tens of µs of host time for this op's ~60
  arguments: docs/perf-notes.md), and serialises calls while Triton's interpreter runs (its
  state is global, not thread-safe).
- **The native route** (``csrc/fast_path.cpp``): after a checked launch, the compiled kernel is
  remembered under the call's *signature* (every tensor's shape, strides, dtype, device and
  16-byte alignment plus the op's static options). Everything Triton specialises on and
  everything the op's checks look at is a function of that signature, so a later call with the
  same signature skips both: its tensors are read, its outputs allocated and the kernel
  launched (``cuLaunchKernel``) by three C++ calls. Only the parameters an op declares per
  call, by name (:class:`KernelLauncher`), change between such launches.
  Inside a compiled graph the same plans are launched by the registered op's C++ kernel
  (``csrc/op_route.cpp``, :meth:`KernelLauncher.serve`), under the same key.

The native route reads Triton's compiled-kernel object, so it is used only on Triton versions
it was verified on (:data:`VERIFIED_TRITON`); elsewhere every call takes Triton's public launch
and one warning says so.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import threading
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from .._interpret import interpreting
from . import _native

__all__ = ["KernelLauncher", "Plan", "param_kinds", "device_of", "route", "native_ready",
           "VERIFIED_TRITON"]

#: Triton versions (major.minor) whose compiled-kernel object the native route was verified on
#: (docs/design.md, "Native launch route": what it reads of each).
VERIFIED_TRITON = ("3.6", "3.8")

# The raw handle of the current stream, as Triton's own launcher gets it (a tenth of the cost of
# building a torch.cuda.Stream object per call); the public route where it is missing.
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                     lambda index: torch.cuda.current_stream(index).cuda_stream)
# torch.cuda.current_device() minus its lazy-init check: a plan exists only after a launch.
current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)

# Triton's interpreter keeps global state: launches from several threads must not interleave.
_interpreter_lock = threading.Lock()
# The per-call scalars the fast path passes on unchecked: 0 or a positive normal float32 (the
# kernel's type); anything else takes the checked path, which judges it.
_FP32_TINY, _FP32_MAX = 2.0**-126, 3.4028234663852886e38
_warned: set[str] = set()
# Above this much shared memory a block needs a launch attribute (Triton 3.8's launcher sets the
# oversized shared-memory mode there) that the native launch does not pass: such kernels keep
# Triton's launch.
_MAX_PLAIN_SHARED = 228 * 1024


def device_of(t: torch.Tensor):
    """Context that makes ``t``'s GPU current (Triton launches on the current device), or a
    no-op off CUDA."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _triton_verified() -> bool:
    return ".".join(triton.__version__.split(".")[:2]) in VERIFIED_TRITON


def route() -> tuple[str, str]:
    """``(route, why)``: which route launches a repeated eager call on a GPU in this process."""
    if interpreting():
        return "interpreter", "TRITON_INTERPRET=1: kernels run in Triton's CPU interpreter"
    if not _triton_verified():
        return "triton", (f"Triton {triton.__version__} is not one the native route was "
                          f"verified on ({', '.join(VERIFIED_TRITON)})")
    if not _no_launch_hooks():
        return "triton", "a Triton launch hook (e.g. its profiler) is installed"
    status = _native.status()
    if status == "native":
        return "native", ("the native helpers are built and loaded (eager calls, and the op inside "
                          "compiled graphs, launch known signatures from C++)")
    return "triton", status


def native_ready() -> bool:
    """Whether a known signature's eager call launches natively in this process now (what
    :func:`route` calls "native"), cheaply: for callers that have a cheaper way than Triton's
    public launch when it does not."""
    return _triton_verified() and _native.signature_fn() is not None and _no_launch_hooks()


def _no_launch_hooks() -> bool:
    """Direct launches skip Triton's launch hooks, so they are used only when none is installed
    (Triton 3.6 and 3.8 keep empty HookChains there rather than None)."""
    runtime = triton.knobs.runtime
    return all(hook is None or not getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


# Triton scalar type -> the native launcher's parameter kind (csrc/fast_path.cpp, kind_size).
_KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "B", "u8": "B",
          "u16": "H", "u32": "I", "u64": "L", "fp32": "f", "f32": "f", "fp64": "d",
          "constexpr": "c"}


def param_kinds(signature: dict) -> str | None:
    """The native launcher's kinds for a kernel compiled by Triton 3.6 or 3.8 with ``signature``
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


class Plan(NamedTuple):
    """A compiled kernel bound to one signature, launched natively with the per-call values."""

    handle: object    # the native plan (csrc/fast_path.cpp, make_launch)
    device_index: int
    run: object       # the native module's launch function
    # Triton's CompiledKernel, held for as long as the plan: the plan launches its CUfunction,
    # which Triton unloads with its module once the object is freed (3.8's __del__), e.g. when
    # a kernel's cache is dropped.
    compiled: object

    def launch(self, values: Sequence) -> None:
        """Launch with the per-call values (addresses, scalars) in the launcher's order."""
        if current_device() == self.device_index:
            self.run(self.handle, raw_stream(self.device_index), *values)
        else:  # a launch goes to the current device: make the tensors' device current
            with torch.cuda.device(self.device_index):
                self.run(self.handle, raw_stream(self.device_index), *values)


class KernelLauncher:
    """One @triton.jit kernel, the names of its per-call parameters, and its native plans.

    ``per_call``: the kernel parameters whose values change from call to call, in the order
    the fast path passes them: input tensors' addresses, then the outputs' (``outputs``), then
    runtime scalars; every other parameter is fixed by the call's signature. ``outputs``:
    (output, input) parameter pairs: the fast path allocates each output the caller does not
    give, contiguous, with the shape and dtype of its input. ``written``: the pointer parameters
    the kernel stores through; ``in_place``: (written, read) pairs that may be the very same
    view. A fast call whose written tensors may share memory with any other argument
    (``_overlap.py``'s rules, run natively) takes the checked path, which names the arguments.
    """

    MAX_PLANS = 4096

    def __init__(self, kernel, per_call: Sequence[str], written: Sequence[str] = (),
                 in_place: Sequence[tuple[str, str]] = (),
                 outputs: Sequence[tuple[str, str]] = ()):
        named = {*written, *(n for pair in (*in_place, *outputs) for n in pair)}
        missing = (set(per_call) - set(kernel.arg_names)) | (named - set(per_call))
        if missing:
            raise ValueError(f"not per-call parameters of {kernel.fn.__name__}: "
                             f"{sorted(missing)}")
        self.kernel = kernel
        self.per_call = tuple(per_call)
        index = self.per_call.index
        n_in = index(outputs[0][0]) if outputs else len(self.per_call)
        if [o for o, _ in outputs] != list(self.per_call[n_in:n_in + len(outputs)]) or any(
                index(like) >= n_in for _, like in outputs):
            raise ValueError("outputs must follow the input tensors in per_call, each shaped "
                             "like an input")
        self.rules = bytes([len(written), *map(index, written), len(in_place),
                            *(index(n) for pair in in_place for n in pair)])
        self._likes = tuple(index(like) for _, like in outputs)
        # The inputs shaped like the outputs, in one C call (itemgetter returns a bare item for
        # one index).
        self._like_of = (operator.itemgetter(*self._likes) if len(self._likes) > 1 else
                         lambda seq, i=self._likes: tuple(seq[j] for j in i))
        self._written_inputs = tuple(index(n) for n in written if index(n) < n_in)
        self._written_bytes = bytes(self._written_inputs)  # for the native bump()
        self._n_pointers = n_in + len(outputs)
        self.plans: dict = {}
        self.op: str | None = None          # the registered op served natively (serve)
        self._op_checked: str | None = None
        self._op_served = False

    def serve(self, op: str, checked: str) -> None:
        """Have the native helpers run registered op ``op`` (``"ns::name"``) on CUDA with this
        launcher's plans, ``checked`` taking every call without one (``_custom_op.py``). Takes
        effect at the first plan made once the helpers are built."""
        self.op, self._op_checked = op, checked

    def clear_plans(self) -> None:
        """Forget every plan, the served op's included: the next calls take the checked path."""
        self.plans.clear()
        module = _native.module()
        if module is not None and self.op is not None:
            module.clear_plans(self.op)

    def launch(self, grid: tuple, args: dict, meta: dict, device: torch.device):
        """Triton's public launch on checked arguments; returns the compiled kernel (None in
        the interpreter)."""
        if interpreting():
            with _interpreter_lock:
                return self.kernel[grid](**args, **meta)
        with torch.cuda.device(device):  # Triton launches on the current device
            return self.kernel[grid](**args, **meta)

    def signature(self, options, tensors: Sequence) -> tuple | None:
        """``(key, addresses)`` of a call through the native signature reader, or None when it
        is not built (or an argument is not a plain tensor: the checked path reports it)."""
        read = _native.signature_fn()
        if read is None:
            return None
        packed = read(self.rules, *tensors)
        if packed is None:
            return None
        return (options, packed[0]), packed[1]

    def find(self, key) -> Plan | None:
        try:
            return self.plans.get(key)
        except TypeError:  # an unhashable option: the checked path reports it
            return None

    def fast_call(self, options, inputs: Sequence, outs: Sequence, scalars: Sequence):
        """The whole fast path: ``inputs``, ``outs`` (the caller's outputs, None where the
        fast path allocates one) and ``scalars`` in ``per_call``'s order. Returns the outputs,
        or None where a checked call is needed (no plan yet, an argument to check, a scalar
        other than 0 or a positive normal float32)."""
        read = _native.signature_fn()
        if read is None or not self.plans:
            return None
        packed = read(self.rules, *inputs, *outs)
        if packed is None:
            return None
        try:
            plan = self.plans.get((options, packed[0]))
        except TypeError:  # an unhashable option: the checked path reports it
            return None
        if plan is None:
            return None
        for x in scalars:  # a loop, not all(<genexpr>) (docs/design.md, "Native launch route")
            if type(x) is not float or not (x == 0.0 or _FP32_TINY <= x <= _FP32_MAX):
                return None
        addresses, n = packed[1], len(outs)
        if n:  # (a launcher without outputs: its caller allocated every tensor)
            made = _native.outputs_fn()(*self._like_of(inputs), *outs)
            outs, addresses[-n:] = made[:n], made[n:]
        plan.launch((*addresses, *scalars))
        # As torch's own in-place ops do: a tensor saved for backward and overwritten here
        # makes that backward raise instead of using stale values; natively, as a Python tuple
        # for torch._C._increment_version costs more than the rest of the call's Python
        # (docs/design.md, "Native launch route").
        _native.bump_fn()(self._written_bytes, inputs, outs)
        return outs

    def remember(self, options, inputs: Sequence, outs: Sequence, launched: tuple,
                 device_index: int, op_options: str | None = None) -> None:
        """After a checked launch of ``inputs`` and ``outs`` (as :meth:`fast_call` takes them)
        that returned ``launched`` = ``(compiled, grid, args, meta)``, keep a native plan for
        the call's signature (no-op where the native route is not in use; the first such
        launch starts building the native helpers). Where an output is what the fast path would
        allocate for it (contiguous, its input's shape and dtype, 16-byte aligned), the plan
        also serves the signature with that output absent: an eager call that leaves it to the
        op takes the plan (docs/design.md, "Native launch route"). ``op_options``: the served
        op's options argument for this call; the op's C++ kernel then takes the plan too."""
        compiled, grid, args, meta = launched
        if compiled is None or interpreting():
            return
        if not _triton_verified():
            _warn_once(route()[1] + "; every call takes Triton's own launch path")
            return
        if not _no_launch_hooks():
            return
        _native.start_build()  # later calls use it once built
        found = self.signature(options, (*inputs, *outs))
        if found is None:
            return
        plan = self._native_plan(compiled, grid, args, meta, device_index)
        if plan is None:
            return
        if len(self.plans) >= self.MAX_PLANS:
            self.clear_plans()  # both routes: each relearns from checked launches
        self.plans[found[0]] = plan = Plan(plan, device_index, _native.module().launch, compiled)
        if self.op is not None and op_options is not None:
            module = _native.module()
            if not self._op_served:
                self._op_served = True
                module.serve_op(self.op, self._op_checked, self.rules, self._n_pointers,
                                len(self.per_call) - self._n_pointers, "CUDA")
            module.add_plan(self.op, op_options, found[0][1], plan.handle)
        for absent in itertools.product(*(((o, None) if _allocated_like(o, inputs[i]) else (o,))
                                          for o, i in zip(outs, self._likes))):
            if None in absent and (key := self.signature(options, (*inputs, *absent))):
                self.plans[key[0]] = plan

    def _native_plan(self, compiled, grid, args: dict, meta: dict, device_index: int):
        """A native launch plan for ``compiled``, or None where the native helpers are not
        built, the kernel needs what Triton's launcher adds (scratch memory, clusters,
        cooperative or PDL launches, an instrumentation's extra parameter, an oversized
        shared-memory mode), or the driver's parameter table disagrees."""
        module = _native.module()
        runner, md = getattr(compiled, "run", None), getattr(compiled, "metadata", None)
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        names = self.kernel.arg_names
        if module is None or not isinstance(signature, dict) or list(signature) != names:
            return None
        if (getattr(md, "num_ctas", None) != 1 or getattr(runner, "launch_cooperative_grid", 1)
                or getattr(runner, "launch_pdl", 1) or getattr(runner, "global_scratch_size", 1)
                or getattr(runner, "profile_scratch_size", 1)
                or getattr(md, "instrumentation_mode", "") or md.shared > _MAX_PLAIN_SHARED):
            return None
        kinds = param_kinds(signature)
        if kinds is None:
            return None
        varying = tuple(names.index(n) for n in self.per_call)
        if any(kinds[i] == "c" for i in varying):  # specialised away: not a per-call parameter
            return None
        values = tuple(_address(args[n]) if n in args else meta[n] for n in names)
        grid = (*grid, 1, 1)[:3]
        return module.make_launch(compiled.function, *grid, 32 * md.num_warps, md.shared,
                                  device_index, kinds, (*values, None, None), varying)


def _allocated_like(out: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``out`` has the signature of what the native ``outputs()`` allocates for
    ``like`` (its shape, dtype and device, row-major strides to the last one, including those
    of size-1 dims, which ``is_contiguous`` ignores, and a 16-byte aligned address): a kernel
    specialised on ``out`` is then the one for any such fresh allocation."""
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        return False
    stride = 1
    for size, got in zip(reversed(out.shape), reversed(out.stride())):
        if got != stride:
            return False
        stride *= size
    return out.data_ptr() % 16 == 0


def _address(x):
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"qkrope: {message}", stacklevel=3)
