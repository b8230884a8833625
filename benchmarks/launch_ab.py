"""A/B of the fast path's two launch routes on suite workloads, in one process, interleaved:
the native helpers (signature, outputs and ``cuLaunchKernel`` from C++, csrc/fast_path.cpp)
against the Python helpers and Triton's own C launcher (``QKROPE_NATIVE=0``).

    python benchmarks/launch_ab.py                      # workloads 1,2,3,6,8,10
    python benchmarks/launch_ab.py --workloads 1,13 --rounds 5

Per route and round: the plan cache is emptied, the call made twice (the checked call that
makes the plan, then one through it), then timed: GPU µs per call (SPEC §3 protocol: CUPTI,
L2 flushed, 50 calls) and host µs per call (the bench's estimator: 2000 back-to-back calls in
5 runs, the median run), with ``x.add_(1)`` timed the same way once per workload. The same
kernel binary runs either way, so GPU times should agree within noise.
"""

import argparse
import statistics

import torch
import triton

import qkrope
from qkrope.bench.timing import L2Flusher, cupti_call_times_us, host_time_per_call_us
from qkrope.ops import _native
from qkrope.ops.qknorm_rope_cache import launcher
from qkrope.suite import SUITE, make_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="1,2,3,6,8,10")
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    module = _native.load(force=True)
    assert module is not None, _native.status()
    flush = L2Flusher()
    x = torch.zeros(16, device="cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {opts.rounds} rounds, routes interleaved")
    print("| # | tokens | native GPU µs | Triton GPU µs | native / Triton | native host µs | "
          "Triton host µs | x.add_(1) host µs | native host / add_ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i in (int(s) for s in opts.workloads.split(",")):
        w = SUITE[i - 1]
        args = make_inputs(w, device="cuda")
        gpu = {True: [], False: []}
        host = {True: [], False: []}
        for _ in range(opts.rounds):
            for native in (True, False):
                _native.set_enabled(native)
                launcher._PLANS.clear()

                def call():
                    return qkrope.run(*args)

                call()
                call()
                (plan,) = launcher._PLANS.values()
                assert (plan.run is module.launch) == native, "not the route under test"
                gpu[native] += cupti_call_times_us(call, flush, iters=50, warmup=10)
                host[native].append(host_time_per_call_us(call, 2000))
        _native.set_enabled(True)
        add = host_time_per_call_us(lambda: x.add_(1), 2000)
        g_n, g_t = statistics.median(gpu[True]), statistics.median(gpu[False])
        h_n, h_t = statistics.median(host[True]), statistics.median(host[False])
        print(f"| {i} | {w.tokens} | {g_n:.2f} | {g_t:.2f} | {g_n / g_t:.3f} | {h_n:.1f} | "
              f"{h_t:.1f} | {add:.1f} | {h_n / add:.2f} |")


if __name__ == "__main__":
    main()
