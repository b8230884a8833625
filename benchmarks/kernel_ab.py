"""A/B of two versions of the fused kernel on suite workloads, in one process, interleaved:
the working tree's kernel against the one at a git revision (docs/perf-notes.md, run 8).

    python benchmarks/kernel_ab.py --rev HEAD~1                 # all 13 workloads
    python benchmarks/kernel_ab.py --rev 6fa308c --workloads 1,3,13

Both versions run with the tile the launcher picks for the workload and the same inputs; each
is timed twice (SPEC §3 protocol, CUPTI, L2 flushed), alternating, and the medians of all calls
are compared. The revision's kernel.py must take the launcher's current arguments.
"""

import argparse
import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile

import torch

from qkrope.bench.timing import L2Flusher, copy_bandwidth, cupti_call_times_us
from qkrope.ops.qknorm_rope_cache import launcher
from qkrope.ops.qknorm_rope_cache.launcher import launch, pick_config
from qkrope.suite import SUITE, bytes_moved, make_inputs

KERNEL = "src/qkrope/ops/qknorm_rope_cache/kernel.py"


def kernel_at(rev: str):
    """The @triton.jit kernel of ``KERNEL`` at git revision ``rev``, imported from a copy."""
    source = subprocess.run(["git", "show", f"{rev}:{KERNEL}"], capture_output=True, text=True,
                            check=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix="_kernel_ab.py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("kernel_ab_old", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernel_ab_old"] = module
    spec.loader.exec_module(module)
    return module.qknorm_rope_cache_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rev", required=True, help="git revision of the 'old' kernel")
    p.add_argument("--workloads", default=",".join(str(i) for i in range(1, 14)))
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args()

    versions = {"old": kernel_at(args.rev), "new": launcher.qknorm_rope_cache_kernel}
    bw, flush = copy_bandwidth(), L2Flusher()
    print(f"{torch.cuda.get_device_name()} | copy bandwidth {bw / 1e12:.2f} TB/s | old = "
          f"{args.rev}, new = working tree")
    print("| # | tokens | floor µs | old µs | new µs | new/old |\n|---|---|---|---|---|---|")
    logs = {"old": 0.0, "new": 0.0}
    which = [int(x) for x in args.workloads.split(",")]
    for n in which:
        w = SUITE[n - 1]
        a = make_inputs(w, device="cuda")
        q_out, k_out = torch.empty_like(a[0]), torch.empty_like(a[1])
        cfg = pick_config(w.batch, a[0].shape[1], a[1].shape[1], w.seq_len, a[0].shape[3], False)
        times = {name: [] for name in versions}
        try:
            for _ in range(2):
                for name, kernel in versions.items():
                    launcher.qknorm_rope_cache_kernel = kernel
                    times[name] += cupti_call_times_us(
                        lambda: launch(*a, q_out, k_out, cfg), flush, iters=args.iters)
        finally:
            launcher.qknorm_rope_cache_kernel = versions["new"]
        med = {name: statistics.median(t) for name, t in times.items()}
        for name in logs:
            logs[name] += math.log(med[name]) / len(which)
        floor = bytes_moved(w) / bw * 1e6
        print(f"| {n} | {w.tokens} | {floor:.2f} | {med['old']:.2f} | {med['new']:.2f} | "
              f"{med['new'] / med['old']:.3f} |", flush=True)
    print(f"geomean µs: old {math.exp(logs['old']):.3f}, new {math.exp(logs['new']):.3f}")


if __name__ == "__main__":
    main()
