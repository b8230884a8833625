"""Probe (docs/perf-notes.md, lead 5 g): is the patched CUDA-graph replay's host surplus the
patch's, or the worker process's? One process holds three models of one preset and seed:
stock, a second stock (the control) and patched, each compiled on a code object of its own
(``mode="reduce-overhead"``), stepped round robin with the order rotating every round, so the
three share the process (hash seed, address layout, the host's speed) and every place in the
order. Per variant: the step's host part (until the forward returned) and wall; then the
paired differences (each step against the stock step of its round) with a bootstrap interval,
and a ``torch.profiler`` table of host ops per step, split by variant (``--profile`` rounds).

    python benchmarks/ro_interleave.py [--model qwen3-8b] [--batch 8,64] [--rounds 300]
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import warnings

import torch

from qkrope.bench.e2e import PROMPT, _forward, _Stepper, build_model

VARIANTS = ("stock", "stock2", "patched")


def _interval(d, level=0.95, n=2000):
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(n))
    return meds[int(n * (1 - level) / 2)], meds[int(n * (1 + level) / 2) - 1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", default="8,64")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--profile", type=int, default=10, help="rounds under torch.profiler")
    p.add_argument("--device", default="cuda", help="cpu: a tiny model, no CUDA graphs (a dry "
                   "run of the probe's code, no figures)")
    args = p.parse_args(argv)
    dev, cpu = args.device, args.device == "cpu"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from qkrope.integrations.transformers import patch

    warnings.simplefilter("ignore")
    models = {v: build_model(args.model, args.layers, dev, tiny=cpu) for v in VARIANTS}
    patch(models["patched"])
    steps = args.rounds + args.profile + 30
    table = []
    for batch in map(int, args.batch.split(",")):
        torch.manual_seed(1)
        stream = torch.randint(0, models["stock"].config.vocab_size,
                               (batch, PROMPT + steps), device=dev)
        st = {v: _Stepper(m, _forward(m, "reduce-overhead", dev), stream, "decode", dev,
                          not cpu) for v, m in models.items()}
        host, wall = collections.defaultdict(list), collections.defaultdict(list)
        order = list(VARIANTS)
        for r in range(20 + args.rounds):
            for v in order[r % 3:] + order[:r % 3]:
                w = st[v].step(r)
                if r >= 20:
                    host[v].append(st[v].host_ms * 1e3)
                    wall[v].append(w * 1e3)
        for v in VARIANTS:  # the logits agree with stock's (a check that the patch ran)
            assert st[v].logits is not None
        d_ok = (st["patched"].logits - st["stock"].logits).abs().max().item()
        self_us = collections.defaultdict(float)
        ops = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (not cpu)) \
                as prof:
            for r in range(20 + args.rounds, 20 + args.rounds + args.profile):
                for v in order[r % 3:] + order[:r % 3]:
                    with record_function(f"step:{v}"):
                        st[v].step(r)
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                continue
            top = e
            while top.cpu_parent is not None:
                top = top.cpu_parent
            if not top.name.startswith("step:") or top is e:
                continue
            v = top.name[5:]
            o = ops[v][e.name[:60]]
            o[0] += 1
            o[1] += e.self_cpu_time_total
            self_us[v] += e.self_cpu_time_total
        print(f"\n### {args.model}, {args.layers} layers, batch {batch} decode, "
              f"{args.rounds} rounds (|patched − stock logits| max {d_ok:.3g})\n")
        print("| variant | host µs median | Δ vs stock (paired, 95%) | wall µs median "
              "| Δ wall vs stock |")
        print("|---|---|---|---|---|")
        for v in VARIANTS:
            dh = [a - b for a, b in zip(host[v], host["stock"])]
            dw = [a - b for a, b in zip(wall[v], wall["stock"])]
            lo, hi = _interval(dh)
            wlo, whi = _interval(dw)
            print(f"| {v} | {statistics.median(host[v]):.1f} | {statistics.median(dh):+.1f} "
                  f"({lo:+.1f}, {hi:+.1f}) | {statistics.median(wall[v]):.1f} | "
                  f"{statistics.median(dw):+.1f} ({wlo:+.1f}, {whi:+.1f}) |")
            table.append((batch, v, statistics.median(host[v]), statistics.median(dh),
                          statistics.median(wall[v]), statistics.median(dw)))
        names = set()
        for v in VARIANTS:
            names |= set(sorted(ops[v], key=lambda n: -ops[v][n][1])[:25])
        print(f"\nHost ops per step under the profiler (calls, self µs), {args.profile} steps "
              f"each; total self µs per step: "
              + ", ".join(f"{v} {self_us[v] / args.profile:.1f}" for v in VARIANTS) + "\n")
        print("| op | " + " | ".join(VARIANTS) + " |")
        print("|---|" + "---|" * len(VARIANTS))
        for n in sorted(names, key=lambda n: -ops["patched"][n][1]):
            print(f"| `{n}` | " + " | ".join(
                f"{ops[v][n][0] / args.profile:.1f}× {ops[v][n][1] / args.profile:.1f}"
                for v in VARIANTS) + " |")
        del st
        torch._dynamo.reset()
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name() if not cpu else 'cpu'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
