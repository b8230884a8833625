"""Does the launch route change GPU time? A/B of the two routes a repeated eager call can take
(src/qkrope/ops/_launch.py), in one process, interleaved: the native route (signature, outputs
and ``cuLaunchKernel`` from C++, csrc/fast_path.cpp) against ``QKROPE_NATIVE=0`` (every call
checked and launched through Triton's public launch). docs/perf-notes.md, run 14.

    python benchmarks/launch_ab.py                        # rows 1,2,3,6,8,10
    python benchmarks/launch_ab.py --rows 1,13,p1 --rounds 5

Per route and round: the native plans are dropped, the call made twice (the checked call that
makes the plan, then one through it where the route has plans), then timed: GPU µs per call
(SPEC §3 protocol: CUPTI, L2 flushed, 50 calls) and host µs per call beside ``x.add_(1)``
(``host_times_beside_us``: runs alternating with add_ runs; × add_ is the median ratio). The
same kernel binary runs either way, so GPU times should agree within noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import parse_rows, require_cuda, row_inputs, row_op  # noqa: E402
from qkrope.bench.timing import L2Flusher, cupti_call_times_us, host_times_beside_us  # noqa: E402
from qkrope.ops import _native  # noqa: E402
from qkrope.ops.qknorm_rope.launcher import LAUNCHER  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", "--workloads", default="1,2,3,6,8,10",
                   help="suite numbers 1-13, paged p1-p3, or S:C:B")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--host-calls", type=int, default=2000, help="per route and round")
    args = p.parse_args()
    try:
        rows = parse_rows(args.rows)
    except ValueError as e:
        p.error(str(e))
    require_cuda("launch_ab.py")
    module = _native.load(timeout=600, force=True)
    if module is None:
        sys.exit(f"launch_ab.py: the native helpers are not available: {_native.status()}")
    flush = L2Flusher()
    x = torch.zeros(16, device="cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {args.rounds} rounds, routes interleaved")
    print("| row | tokens | native GPU µs | checked GPU µs | native / checked | "
          "native host µs | × add_ | checked host µs | × add_ |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        a = row_inputs(row, device="cuda")
        op = row_op(row)
        gpu = {True: [], False: []}
        host = {True: [], False: []}
        for _ in range(args.rounds):
            for native in (True, False):
                _native.set_enabled(native)
                LAUNCHER.plans.clear()

                def call():
                    return op(*a)

                call()
                call()
                plans = list(LAUNCHER.plans.values())
                if native != bool(plans) or any(pl.run is not module.launch for pl in plans):
                    raise RuntimeError(f"row {row.label}: route {'native' if native else 'checked'}"
                                       f" not under test (plans: {len(plans)})")
                gpu[native] += cupti_call_times_us(call, flush, iters=50, warmup=10)
                us, _, ratio = host_times_beside_us(call, lambda: x.add_(1), args.host_calls)
                host[native].append((us, ratio))
        _native.set_enabled(True)
        g = {n: statistics.median(gpu[n]) for n in gpu}
        h = {n: statistics.median(u for u, _ in host[n]) for n in host}
        r = {n: statistics.median(q for _, q in host[n]) for n in host}
        print(f"| {row.label} | {row.workload.tokens} | {g[True]:.2f} | {g[False]:.2f} | "
              f"{g[True] / g[False]:.3f} | {h[True]:.1f} | {r[True]:.2f} | {h[False]:.1f} | "
              f"{r[False]:.2f} |", flush=True)
        del a
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
