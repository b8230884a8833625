"""Probe: where a CUDA-graph replayed decode step's host part goes, stock against patched,
each in worker processes of its own (alternating, pinned to one core as ``qkrope bench
--e2e`` pins its workers). The question of docs/perf-notes.md lead 5 (g): the bench's
patched workers read +7 to +36 µs of host part a reduce-overhead decode step that no
profiler or call count shows. Per step it splits the host part into the CUDA-graph tree's
own Python (``CUDAGraphTreeManager.run`` less the node's run), the node's input and output
handling (``CUDAGraphNode.run`` less ``run_graph``), the replay itself (``run_graph``:
``cudaGraphLaunch``), and what lies outside the tree (Dynamo's cache lookup and guards,
AOT and Inductor wrappers, the step's own tensors); beside it, the guards checked alone.
Remove it once it has answered (its answer goes into perf-notes.md and design.md).

    python benchmarks/ro_host_probe.py [--model qwen3-8b] [--batch 8] [--rounds 2]
        [--steps 300]

GPU (without one, a dry run on the tiny model through Dynamo's eager backend, no CUDA graph).
"""
import argparse
import multiprocessing as mp
import pathlib
import statistics
import sys
import time
import warnings

import torch


def worker(variant, preset, batch, steps, q):
    from qkrope.bench import e2e
    from qkrope.ops import _native

    e2e._pin(e2e._timing_core())
    warnings.simplefilter("ignore")
    if _native.enabled():
        _native.load(timeout=300)
    import torch._inductor.cudagraph_trees as ct
    from qkrope.integrations.transformers import patch

    acc = {"tree": 0.0, "node": 0.0, "replay": 0.0}

    def timed(cls, name, key):
        orig = getattr(cls, name)

        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
        setattr(cls, name, w)

    timed(ct.CUDAGraphTreeManager, "run", "tree")
    timed(ct.CUDAGraphNode, "run", "node")
    timed(ct.CUDAGraphNode, "run_graph", "replay")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of this script
    model = e2e.build_model(preset, 4, dev, tiny=dev == "cpu")
    if variant == "patched":
        patch(model)
    torch.manual_seed(1)
    stream = torch.randint(0, model.config.vocab_size, (batch, e2e.PROMPT + steps + 40),
                           device=dev)
    st = e2e._Stepper(model, e2e._forward(model, "reduce-overhead", dev), stream, "decode",
                      dev, dev == "cuda")
    for i in range(20):
        st.step(i)
    rows = []
    for i in range(20, 20 + steps):
        for k in acc:
            acc[k] = 0.0
        wall = st.step(i)
        rows.append((st.host_ms * 1e3, acc["tree"] * 1e6, acc["node"] * 1e6,
                     acc["replay"] * 1e6, wall * 1e3))
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from e2e_profile import _guard_us
    q.put((variant, rows, _guard_us(st, 20 + steps)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, alternating")
    p.add_argument("--steps", type=int, default=300, help="timed decode steps per process")
    args = p.parse_args()
    from qkrope.ops import _native
    if torch.cuda.is_available() and _native.enabled():
        print("native:", _native.build(timeout=300))
    ctx = mp.get_context("spawn")
    res = {"stock": [], "patched": []}
    for r in range(args.rounds):
        for v in (("stock", "patched") if r % 2 == 0 else ("patched", "stock")):
            q = ctx.Queue()
            proc = ctx.Process(target=worker, args=(v, args.model, args.batch, args.steps, q))
            proc.start()
            try:  # (bounded: a worker that hangs or dies is killed, never waited on)
                out = q.get(timeout=400)
            finally:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()
            med = [statistics.median(c) for c in zip(*out[1])]
            res[v].append((med, out[2]))
            print(f"round {r} {v}: host {med[0]:.1f} tree {med[1]:.1f} node {med[2]:.1f} "
                  f"replay {med[3]:.1f} wall {med[4]:.1f} guards {out[2]}", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{args.model} batch {args.batch} reduce-overhead decode, 4 layers, torch "
          f"{torch.__version__}, {gpu}; medians per step, µs, one row per process\n")
    print("| variant | host | outside the tree | tree − node | node − replay | "
          "replay (cudaGraphLaunch) | guards alone (count) | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for v in ("stock", "patched"):
        for m, g in res[v]:
            print(f"| {v} | {m[0]:.1f} | {m[0] - m[1]:.1f} | {m[1] - m[2]:.1f} | "
                  f"{m[2] - m[3]:.1f} | {m[3]:.1f} | {g[1]:.1f} ({g[0]}) | {m[4]:.1f} |")


if __name__ == "__main__":
    main()
