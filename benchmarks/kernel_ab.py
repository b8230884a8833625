"""A/B of the op at a git revision against the working tree, through the public API, on the
suite and the paged workloads, interleaved in one run (how every figure of docs/design.md that
compares two kernels was taken).

    python benchmarks/kernel_ab.py --rev c847d97                  # every suite + paged row
    python benchmarks/kernel_ab.py --rev HEAD~1 --workloads 1,2,p1 --rounds 3
    python benchmarks/kernel_ab.py --rev c847d97 --variant skeleton --variant no_trig
    python benchmarks/kernel_ab.py --rev c847d97 --tree probe=/tmp/probe/src   # any src/ copy
    python benchmarks/kernel_ab.py --rev main --model qwen3.5-27b --workloads 1,2,3,13

"old" is the first ``--rev``; further ``--rev``s, ``--variant NAME`` (the working tree with a
kernel variant of benchmarks/variants.py applied) and ``--tree NAME=SRC`` (a patched copy of
``src/``) are timed in the same rounds and reported as ratios to "old" beside "new" (the
working tree).

Each version runs in its own worker process (its own ``qkrope`` package: the revision's
``src/`` from ``git archive``, or the working tree's), so versions whose launchers take other
arguments compare fairly. Rounds alternate old, new, old, new...; per row the medians of all
calls of each version are compared. GPU time: the SPEC protocol (CUPTI, L2 flushed before
every call); host time: back-to-back eager calls with outputs allocated (native route), as a
multiple of ``x.add_(1)`` timed alternately in the same process (absolute host µs drift by 1.5x
between processes on a shared host). Each worker also times a copy of the row's bytes (the
faster of torch's copy and a Triton streaming copy, bench's same-bytes copy); "copy µs" is the
median over every worker, so each version reads as a ratio to a copy measured in the same run.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variants import VARIANTS, write_tree  # noqa: E402

WORKER = r"""
import json, statistics, sys, torch, qkrope
from qkrope.bench.timing import (L2Flusher, cupti_call_times_us, host_times_beside_us,
                                 same_bytes_copies)
from qkrope.suite import MODELS, SUITE, PAGED_SUITE, bytes_moved, make_inputs, make_paged_inputs
from qkrope.ops import _native
rows, iters, host_calls = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
model = MODELS[sys.argv[4]]
opts = model.options()  # partial rotary, (1 + w) norms
load = getattr(_native, "build", None)
(load(timeout=300) if load else _native.load(300))
flush, out = L2Flusher(), {}
for r in rows:
    g = torch.Generator(device="cuda").manual_seed(0)
    if r.startswith("p"):
        w = PAGED_SUITE[int(r[1:]) - 1]
        a = make_paged_inputs(w, model, device="cuda", generator=g)
        op = qkrope.fused_qk_norm_rope_paged
    else:
        w = SUITE[int(r) - 1]
        a = make_inputs(w, model, device="cuda", generator=g)
        op = qkrope.run
    qo, ko = torch.empty_like(a[0]), torch.empty_like(a[1])
    gpu = cupti_call_times_us(lambda: op(*a, query_out=qo, key_out=ko, **opts), flush,
                              iters=iters)
    host = ratio = None
    if host_calls:  # beside x.add_(1), alternating: a shared host drifts between processes
        x = torch.zeros(1, device="cuda")
        host, _, ratio = host_times_beside_us(lambda: op(*a, **opts), lambda: x.add_(1),
                                              calls=host_calls)
    # The faster of torch's and a Triton streaming copy of the op's bytes, same protocol.
    copy = min(statistics.median(cupti_call_times_us(c, flush, iters=iters))
               for c in same_bytes_copies(bytes_moved(w, model))[2].values())
    out[r] = dict(gpu=gpu, host=host, host_per_add=ratio, copy=copy)
print("RESULT " + json.dumps(dict(rows=out, route=_native.status(), triton=__import__("triton").__version__)))
"""


def tree_at(rev: str, into: str) -> str:
    """``src/`` of ``rev`` unpacked under ``into``; returns the path to put on sys.path."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "src"], check=True,
                             capture_output=True).stdout
    os.makedirs(into, exist_ok=True)
    path = os.path.join(into, "archive.tar")
    with open(path, "wb") as f:
        f.write(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return os.path.join(into, "src")


def run_worker(src: str, rows: list[str], iters: int, host_calls: int, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", WORKER, ",".join(rows), str(iters),
                          str(host_calls), model], env=env, capture_output=True, text=True,
                         timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker for {src} failed:\n{out.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rev", required=True, action="append",
                   help="git revision of the 'old' version (repeat: more versions)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME",
                   help="another version: the working tree with this kernel variant "
                        "(benchmarks/variants.py: " + ", ".join(VARIANTS) + ")")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=SRC",
                   help="another version: a src/ directory (e.g. a patched copy)")
    p.add_argument("--workloads", default=",".join([*map(str, range(1, 14)), "p1", "p2", "p3"]),
                   help="suite rows 1-13 and paged rows p1-p3 (default: all)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--host-calls", type=int, default=1000)
    p.add_argument("--model", default="qwen3-coder-480b",
                   help="head geometry of the rows, with its options (default: the suite's)")
    p.add_argument("--json", help="write every measured call here")
    args = p.parse_args()
    for name in args.variant:
        if name not in VARIANTS:
            p.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")

    rows = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"old": tree_at(args.rev[0], os.path.join(tmp, "old"))}
        for rev in args.rev[1:]:
            versions[rev] = tree_at(rev, os.path.join(tmp, rev))
        versions["new"] = os.path.join(os.path.dirname(os.path.dirname(__file__)) or ".", "src")
        for name in args.variant:
            versions[name] = str(write_tree(name, os.path.join(tmp, "variants")))
        for spec in args.tree:
            name, _, src = spec.partition("=")
            versions[name] = src
        runs = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, src in versions.items():
                runs[name].append(run_worker(src, rows, args.iters, args.host_calls,
                                             args.model))
    import torch
    import triton

    extra = [n for n in versions if n not in ("old", "new")]
    print(f"{torch.cuda.get_device_name()} | {args.model} | torch {torch.__version__} | triton "
          f"{triton.__version__} | old = {args.rev[0]} ({runs['old'][0]['route']}), new = working "
          f"tree ({runs['new'][0]['route']}){''.join(f', {n}' for n in extra)} | {args.rounds} "
          f"rounds x {args.iters} calls, interleaved")
    print("| row | old µs | new µs | new/old | " + "".join(f"{n}/old | " for n in extra)
          + "old host ×add_ | new host ×add_ | host new/old | copy µs | new/copy | "
          + "".join(f"{n}/copy | " for n in extra) + "\n|---|---|---|---|"
          + "---|" * len(extra) + "---|---|---|---|---|" + "---|" * len(extra))
    logs = {n: 0.0 for n in versions}
    suite_rows = [r for r in rows if not r.startswith("p")]
    table = {}
    for r in rows:
        med = {n: statistics.median(t for run in runs[n] for t in run["rows"][r]["gpu"])
               for n in versions}
        host = {n: statistics.median(run["rows"][r]["host_per_add"] for run in runs[n])
                if runs[n][0]["rows"][r]["host"] is not None else math.nan for n in versions}
        if r in suite_rows:
            for n in logs:
                logs[n] += math.log(med[n]) / len(suite_rows)
        copy = statistics.median(run["rows"][r]["copy"] for n in versions for run in runs[n])
        table[r] = dict(gpu=med, host=host, copy=copy)
        print(f"| {r} | {med['old']:.2f} | {med['new']:.2f} | {med['new'] / med['old']:.3f} | "
              + "".join(f"{med[n] / med['old']:.3f} | " for n in extra)
              + f"{host['old']:.2f} | {host['new']:.2f} | {host['new'] / host['old']:.3f} | "
              + f"{copy:.2f} | {med['new'] / copy:.3f} | "
              + "".join(f"{med[n] / copy:.3f} | " for n in extra), flush=True)
    if suite_rows:
        print("suite geomean µs: " + ", ".join(f"{n} {math.exp(v):.3f}" for n, v in logs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rev=args.rev, table=table, runs=runs), f)


if __name__ == "__main__":
    main()
