"""Probe: how far apart is one variant's step time in several worker processes of
``qkrope bench --e2e``, and what narrows it (docs/perf-notes.md, lead 5 g).

Groups of worker processes of ONE variant (same model, same cell), timed in turns on one core
(as the bench does): ``free`` as the bench spawns them; ``seed0`` with PYTHONHASHSEED=0;
``node`` pinned from birth to the NUMA node of the timing core (one core where the machine has
one node); ``core`` pinned from birth to the timing core. Per process: median host part and
wall ms per step. GPU only.

    python benchmarks/process_spread.py [--variant stock] [--cell reduce-overhead:8:decode]
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import time

import torch

from qkrope.bench import e2e


def node_cpus(core: int) -> set[int]:
    for node in glob.glob("/sys/devices/system/node/node*"):
        cpus = set()
        for part in open(f"{node}/cpulist").read().strip().split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if core in cpus:
            return cpus
    return {core}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="stock")
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--cell", default="reduce-overhead:8:decode")
    ap.add_argument("--groups", default="free:5,seed0:4,node:4")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    mode, batch, phase = args.cell.split(":")
    core = e2e._timing_core()
    node = node_cpus(core)
    print(f"timing core {core}; its node's cpus {sorted(node)}; all {sorted(os.sched_getaffinity(0))}")
    from qkrope.ops import _native

    if _native.enabled():
        _native.load(timeout=600)
    procs = []
    t0 = time.time()
    for spec in args.groups.split(","):
        group, n = spec.split(":")
        for _ in range(int(n)):
            old = os.environ.get("PYTHONHASHSEED")
            if group == "seed0":
                os.environ["PYTHONHASHSEED"] = "0"
            w = e2e._Worker(args.variant, args.model, 4, "cuda", 0, 600.0)
            if old is None:
                os.environ.pop("PYTHONHASHSEED", None)
            if group in ("node", "core"):  # its main thread, before it has imported torch
                os.sched_setaffinity(w.proc.pid, node if group == "node" else {core})
            procs.append((group, w))
    for _, w in procs:
        w.result()
    g = torch.Generator().manual_seed(int(batch))
    stream = torch.randint(0, e2e.VOCAB, (int(batch), e2e.PROMPT + 5 + 150), generator=g)
    for _, w in procs:
        w.send("setup", mode, phase, stream, 5)
    for _, w in procs:
        w.result()
    print(f"built and compiled in {time.time() - t0:.0f} s")
    times = {i: [] for i in range(len(procs))}
    for r in range(args.rounds):
        order = list(range(len(procs)))
        order = order[r % len(order):] + order[:r % len(order)]
        start = 5 + (r * 10) % 140
        for i in order:
            times[i] += procs[i][1].call("block", start, start + 10, core)
    print("| process | group | host ms (median) | wall ms (median) |")
    print("|---|---|---|---|")
    by_group = {}
    for i, (group, w) in enumerate(procs):
        host = statistics.median(h for _, h in times[i])
        wall = statistics.median(t for t, _ in times[i])
        by_group.setdefault(group, []).append((host, wall))
        print(f"| {i} | {group} | {host:.4f} | {wall:.4f} |")
        w.close()
    print("| group | host min-max | host spread | wall min-max | wall spread |")
    print("|---|---|---|---|---|")
    for group, rows in by_group.items():
        h = [x for x, _ in rows]
        t = [y for _, y in rows]
        print(f"| {group} | {min(h):.4f}-{max(h):.4f} | {max(h) / min(h) - 1:.1%} | "
              f"{min(t):.4f}-{max(t):.4f} | {max(t) / min(t) - 1:.1%} |")


if __name__ == "__main__":
    main()
