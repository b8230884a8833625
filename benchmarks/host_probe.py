"""Host µs per eager call on a GPU machine, and its parts, against torch's ``x.add_(1)``:
the measurement behind issue 4's host target (docs/perf-notes.md, runs 7 and 10).

    python benchmarks/host_probe.py            # Python helpers, then the native ones

Each row: 3000 back-to-back calls in 3 runs (wall clock, synchronised at the end of each run),
the median run, for the 1-token decode workload (SPEC #1). (Runs 7 and 10 of
docs/perf-notes.md took the best run instead.) The fast path's native helpers (signature and
output allocation, qkrope/ops/_native.py) are built if possible (~30 s on a first run) and
measured in the same process as the Python ones, so both columns share one machine instance.
"""

import time

import torch
import triton
import triton.language as tl

import qkrope
from qkrope.bench.timing import host_time_per_call_us
from qkrope.ops import _native
from qkrope.ops._direct_launch import outputs, signature
from qkrope.ops.qknorm_rope_cache import launcher
from qkrope.suite import SUITE, make_inputs


def host_us(fn) -> float:
    """µs per call: 3000 back-to-back calls in 3 runs, the median run (the bench's estimator)."""
    return host_time_per_call_us(fn, calls=3000, batches=3)


@triton.jit
def trivial_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def rows(args, q_out, k_out):
    q, k = args[0], args[1]
    tensors = list(args[:10])
    f = qkrope.run
    f(*args)
    f(*args, query_out=q_out, key_out=k_out)  # the checked calls that create the plans
    addresses = []
    plan = launcher._PLANS.find(signature(False, (*tensors, q_out, k_out), addresses))
    assert plan is not None, "no plan: the fast path is not taken"
    return [
        ("qkrope, outputs preallocated", lambda: f(*args, query_out=q_out, key_out=k_out)),
        ("qkrope, outputs allocated", lambda: f(*args)),
        ("  signature + plan lookup",
         lambda: launcher._PLANS.find(signature(False, (*tensors, q_out, k_out), []))),
        ("  launch of the plan", lambda: plan.launch(addresses, 1e-6)),
        ("  allocation of both outputs", lambda: outputs(q, k, None, None)),
    ]


def main():
    args = make_inputs(SUITE[0], device="cuda", cache_capacity=64)
    q_out, k_out = torch.empty_like(args[0]), torch.empty_like(args[1])
    x = torch.zeros(16, device="cuda")
    add = host_us(lambda: x.add_(1))
    base = [("x.add_(1)", add),
            ("trivial 3-argument Triton kernel, kernel[grid](...)",
             host_us(lambda: trivial_kernel[(1,)](x, 16, BLOCK=16)))]

    _native.set_enabled(False)
    python = [(name, host_us(fn)) for name, fn in rows(args, q_out, k_out)]
    _native.set_enabled(True)
    t0 = time.perf_counter()
    built = _native.load() is not None
    build_s = time.perf_counter() - t0
    native = [(name, host_us(fn)) for name, fn in rows(args, q_out, k_out)] if built else []

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | native helpers: {_native.status()} ({build_s:.1f} s)")
    print("| what | Python helpers µs | × add_ | native helpers µs | × add_ |")
    print("|---|---|---|---|---|")
    for name, t in base:
        print(f"| {name} | {t:.2f} | {t / add:.2f} | | |")
    for i, (name, t) in enumerate(python):
        nat = f"{native[i][1]:.2f} | {native[i][1] / add:.2f}" if native else "— | —"
        print(f"| {name} | {t:.2f} | {t / add:.2f} | {nat} |")


if __name__ == "__main__":
    main()
