"""A/B of the op at a git revision against the working tree, through the public API, on the
suite and the paged workloads, interleaved in one run (docs/perf-notes.md).

    python benchmarks/kernel_ab.py --rev c847d97                  # every suite + paged row
    python benchmarks/kernel_ab.py --rev HEAD~1 --workloads 1,2,p1 --rounds 3

Each version runs in its own worker process (its own ``qkrope`` package: the revision's
``src/`` from ``git archive``, or the working tree's), so versions whose launchers take other
arguments compare fairly. Rounds alternate old, new, old, new...; per row the medians of all
calls of each version are compared. GPU time: the SPEC protocol (CUPTI, L2 flushed before
every call); host time: back-to-back eager calls with outputs allocated (native route).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

WORKER = r"""
import json, sys, torch, qkrope
from qkrope.bench.timing import L2Flusher, cupti_call_times_us, host_time_per_call_us
from qkrope.suite import SUITE, PAGED_SUITE, make_inputs, make_paged_inputs
from qkrope.ops import _native
rows, iters, host_calls = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
load = getattr(_native, "build", None)
(load(timeout=300) if load else _native.load(300))
flush, out = L2Flusher(), {}
for r in rows:
    g = torch.Generator(device="cuda").manual_seed(0)
    if r.startswith("p"):
        a = make_paged_inputs(PAGED_SUITE[int(r[1:]) - 1], device="cuda", generator=g)
        op = qkrope.fused_qk_norm_rope_paged
    else:
        a = make_inputs(SUITE[int(r) - 1], device="cuda", generator=g)
        op = qkrope.run
    qo, ko = torch.empty_like(a[0]), torch.empty_like(a[1])
    gpu = cupti_call_times_us(lambda: op(*a, query_out=qo, key_out=ko), flush, iters=iters)
    host = host_time_per_call_us(lambda: op(*a), calls=host_calls) if host_calls else None
    out[r] = dict(gpu=gpu, host=host)
print("RESULT " + json.dumps(dict(rows=out, route=_native.status(), triton=__import__("triton").__version__)))
"""


def tree_at(rev: str, into: str) -> str:
    """``src/`` of ``rev`` unpacked under ``into``; returns the path to put on sys.path."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "src"], check=True,
                             capture_output=True).stdout
    path = os.path.join(into, "archive.tar")
    with open(path, "wb") as f:
        f.write(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def run_worker(src: str, rows: list[str], iters: int, host_calls: int) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", WORKER, ",".join(rows), str(iters),
                          str(host_calls)], env=env, capture_output=True, text=True,
                         timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker for {src} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rev", required=True, help="git revision of the 'old' version")
    p.add_argument("--workloads", default=",".join([*map(str, range(1, 14)), "p1", "p2", "p3"]),
                   help="suite rows 1-13 and paged rows p1-p3 (default: all)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--host-calls", type=int, default=1000)
    p.add_argument("--json", help="write every measured call here")
    args = p.parse_args()

    rows = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"old": tree_at(args.rev, tmp),
                    "new": os.path.join(os.path.dirname(os.path.dirname(__file__)) or ".", "src")}
        runs = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, src in versions.items():
                runs[name].append(run_worker(src, rows, args.iters, args.host_calls))
    import torch
    import triton

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | old = {args.rev} ({runs['old'][0]['route']}), new = working "
          f"tree ({runs['new'][0]['route']}) | {args.rounds} rounds x {args.iters} calls, "
          "interleaved")
    print("| row | old µs | new µs | new/old | old host µs | new host µs | host new/old |\n"
          "|---|---|---|---|---|---|---|")
    logs = {"old": 0.0, "new": 0.0}
    suite_rows = [r for r in rows if not r.startswith("p")]
    table = {}
    for r in rows:
        med = {n: statistics.median(t for run in runs[n] for t in run["rows"][r]["gpu"])
               for n in versions}
        host = {n: statistics.median(run["rows"][r]["host"] for run in runs[n])
                if runs[n][0]["rows"][r]["host"] is not None else math.nan for n in versions}
        if r in suite_rows:
            for n in logs:
                logs[n] += math.log(med[n]) / len(suite_rows)
        table[r] = dict(gpu=med, host=host)
        print(f"| {r} | {med['old']:.2f} | {med['new']:.2f} | {med['new'] / med['old']:.3f} | "
              f"{host['old']:.2f} | {host['new']:.2f} | {host['new'] / host['old']:.3f} |",
              flush=True)
    if suite_rows:
        print(f"suite geomean µs: old {math.exp(logs['old']):.3f}, new {math.exp(logs['new']):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rev=args.rev, table=table, runs=runs), f)


if __name__ == "__main__":
    main()
