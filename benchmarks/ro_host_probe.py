"""Probe: where a reduce-overhead decode step's host time goes, stock against patched.

    python benchmarks/ro_host_probe.py [--model qwen3-8b] [--batch 8] [--order sppssp]

Each letter of ``--order`` is one process (s stock, p patched), run one after the other: per
process the step's host part (until the forward returned), its split at the CUDA-graph launch
(torch.profiler: step start -> cudaGraphLaunch -> forward returned), the guards, and cProfile's
functions by own time per step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import warnings

import torch


def one(variant: str, model_name: str, batch: int, steps: int) -> dict:
    from qkrope.bench.e2e import PROMPT, _forward, _pin, _Stepper, _timing_core, build_model
    from qkrope.integrations.transformers import patch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e_profile import _guard_us

    warnings.simplefilter("ignore")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of the probe
    model = build_model(model_name, 4, dev, tiny=dev == "cpu")
    if variant in "pS":
        patch(model)
    if variant == "S":  # stock, in a process where the op has run (native helper loaded)
        from qkrope.integrations.transformers import unpatch
        with torch.no_grad():
            model(torch.zeros((1, 8), dtype=torch.long, device=dev))
        unpatch(model)
        torch._dynamo.reset()
    torch.manual_seed(1)
    n = 10 + 3 * steps + 60
    stream = torch.randint(0, model.config.vocab_size, (batch, PROMPT + n + 4), device=dev)
    mode = "reduce-overhead" if dev == "cuda" else "eager"
    st = _Stepper(model, _forward(model, mode, dev), stream, "decode", dev, dev == "cuda")
    for i in range(10):
        st.step(i)
    _pin(_timing_core())
    # forward call -> CUDAGraph.replay entry (guards, Dynamo's code, AOT and cudagraph-tree
    # wrappers: the GPU idles through it), replay, replay exit -> forward returned
    T = {}
    graph_cls = torch.cuda.graphs.CUDAGraph
    replay = graph_cls.replay

    def timed_replay(self):
        T["a"] = time.perf_counter()
        replay(self)
        T["b"] = time.perf_counter()

    graph_cls.replay = timed_replay
    fwd = st.forward

    def timed_forward(*args, **kwargs):
        T["s"] = time.perf_counter()
        out = fwd(*args, **kwargs)
        T["e"] = time.perf_counter()
        return out

    st.forward = timed_forward
    walls, hosts, pre, launch, post = [], [], [], [], []
    for i in range(10, 10 + steps):
        walls.append(st.step(i))
        hosts.append(st.host_ms)
        if dev == "cuda":
            pre.append((T["a"] - T["s"]) * 1e6)
            launch.append((T["b"] - T["a"]) * 1e6)
            post.append((T["e"] - T["b"]) * 1e6)
    graph_cls.replay = replay
    st.forward = fwd
    i0 = 10 + steps
    pr = cProfile.Profile()
    pr.enable()
    for i in range(i0, i0 + steps):
        st.step(i)
    pr.disable()
    i0 += steps
    stats = pstats.Stats(pr).stats
    funcs = {}
    for (file, line, name), (cc, nc, tt, ct, callers) in stats.items():
        funcs[f"{os.path.basename(file)}:{line}:{name}"] = (nc / steps, tt / steps * 1e6)
    guards = _guard_us(st, i0) if dev == "cuda" else None
    med = statistics.median
    return dict(variant=variant, wall=med(walls), host=med(hosts) * 1e3,
                pre=med(pre) if pre else None,
                launch=med(launch) if launch else None, post=med(post) if post else None,
                n_launch=len(pre), guards=guards, funcs=funcs)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--order", default="sppssp")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--one")
    p.add_argument("--out", default="/tmp/ro_probe")
    a = p.parse_args()
    if a.one:
        r = one(a.one[0], a.model, a.batch, a.steps)
        with open(a.one[1:], "w") as f:
            json.dump(r, f)
        return 0
    os.makedirs(a.out, exist_ok=True)
    res = []
    for k, v in enumerate(a.order):
        path = os.path.join(a.out, f"{k}{v}.json")
        t = time.time()
        subprocess.run([sys.executable, __file__, "--model", a.model, "--batch", str(a.batch),
                        "--steps", str(a.steps), "--one", v + path], check=True)
        res.append(json.load(open(path)))
        r = res[-1]
        print(f"{k} {v}: wall {r['wall']:.4f} ms, host {r['host']:.1f} µs: to replay "
              f"{r['pre'] or 0:.1f}, replay {r['launch'] or 0:.1f}, after {r['post'] or 0:.1f}; "
              f"guards {r['guards']}; {time.time() - t:.0f} s", flush=True)
    # functions: mean µs per step by variant, the largest differences
    by = {v: [x for x in res if x["variant"] == v] for v in "sp"}
    for v in "sSp":
        xs = [x for x in res if x["variant"] == v]
        if xs and xs[0]["pre"] is not None:
            print(v, "mean of processes: host %.1f pre %.1f replay %.1f post %.1f µs" % tuple(
                statistics.mean(x[k] for x in xs) for k in ("host", "pre", "launch", "post")))
    names = set().union(*(x["funcs"] for x in res))
    rows = []
    for nm in names:
        m = {v: statistics.mean(x["funcs"].get(nm, (0, 0))[1] for x in by[v]) for v in by}
        c = {v: statistics.mean(x["funcs"].get(nm, (0, 0))[0] for x in by[v]) for v in by}
        rows.append((m["p"] - m["s"], nm, m["s"], m["p"], c["s"], c["p"]))
    rows.sort(key=lambda r: -abs(r[0]))
    print("\nown µs per step, patched - stock (stock / patched; calls per step s / p):")
    for d, nm, s, q, cs, cq in rows[:30]:
        print(f"{d:+7.2f}  {s:7.2f} / {q:7.2f}  ({cs:.0f} / {cq:.0f})  {nm[:90]}")
    tot = {v: [sum(t for _, t in x["funcs"].values()) for x in by[v]] for v in by}
    print("cProfile total own µs per step:", {v: [round(t, 1) for t in tot[v]] for v in tot})
    return 0


if __name__ == "__main__":
    sys.exit(main())
