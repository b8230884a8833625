"""What one step of the e2e model launches, stock against patched: per step the CUDA kernels
(count and GPU µs, by name), in compiled modes the guards checked before every call (how many,
and their µs alone) and the host hot spots (``torch.profiler``: the patched step's in
``torch.compile``, both variants' in reduce-overhead). The tool behind the compiled cells of
BENCHMARKS.md's end-to-end table: where ``qkrope bench --e2e`` shows patched ≈ stock, this
shows whether the step differs in GPU work (kernels the patch adds or removes) or in host time
(the op's call in the graph).

    python benchmarks/e2e_profile.py [--model qwen3-8b] [--cells reduce-overhead:1:decode,...]
        [--variants stock,patched[,free]] [--steps 20] [--json rows.json]

Same model, caches and steps as ``qkrope bench --e2e`` (``qkrope.bench.e2e``); GPU only. The
variants run one after the other in this process, each ``--steps`` timed steps: no
interleaving, so a wall clock here is no speed-up (``qkrope bench --e2e`` gives those). Each
step's host part (until the forward returned) is kept beside its wall time. ``--variants
...,free`` adds the patched model with a prologue reduced to a copy of the new K/V rows into
the cache (no norm, no rotary, no row addressing; its logits are wrong): stock ÷ free is about
the most any implementation of the prologue can gain in that cell, the bound a target such as
"batch 1 eager ≥ 1.3×" is checked against (docs/perf-notes.md, lead 7).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
import warnings

import torch

from qkrope.bench.e2e import PROMPT, step_guards


def _profile(stepper, first: int, n: int):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(first, first + n):
            stepper.step(i)
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            k = kernels[e.name[:80]]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    return prof, kernels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--cells", default="reduce-overhead:1:decode,reduce-overhead:8:decode,"
                   "compile:1:decode,compile:1:prefill", help="MODE:BATCH:PHASE,...")
    p.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    p.add_argument("--variants", default="stock,patched",
                   help="of stock, patched, free (the patched model with a prologue reduced "
                        "to copying the new K/V rows into the cache, wrong logits: about the "
                        "most any prologue could gain)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and cell")
    p.add_argument("--json", help="write one row per cell and variant here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_profile.py needs CUDA")
        return 1
    from qkrope.bench.e2e import _forward, _Stepper, build_model
    from qkrope.integrations import transformers as layer_module
    from qkrope.integrations.transformers import patch, unpatch

    prologue = layer_module._prologue

    warnings.simplefilter("ignore")
    model = build_model(args.model, args.layers, "cuda")
    variants = [v for v in ("stock", "patched", "free") if v in args.variants.split(",")]
    rows, records = [], []
    for cell in args.cells.split(","):
        mode, batch, phase = cell.split(":")
        torch.manual_seed(1)
        stream = torch.randint(0, model.config.vocab_size,
                               (int(batch), 512 if phase == "prefill"
                                else PROMPT + args.steps + 20),
                               device="cuda")
        per = {}
        for variant in variants:
            torch._dynamo.reset()
            (unpatch if variant == "stock" else patch)(model)
            layer_module._prologue = _free_prologue if variant == "free" else prologue
            st = _Stepper(model, _forward(model, mode, "cuda"), stream, phase, "cuda",
                          mode == "reduce-overhead")
            at = (lambda i: i) if phase == "decode" else (lambda i: 0)
            for i in range(8):
                st.step(at(i))
            end = 8 + args.steps
            walls, hosts = [], []
            for i in range(8, end):
                walls.append(st.step(at(i)))
                hosts.append(st.host_ms)
            guards = _guard_us(st, at(end)) if mode != "eager" else None
            n = 5
            prof, kernels = _profile(_StepAt(st, at), end, n)
            count = sum(v[0] for v in kernels.values()) / n
            gpu = sum(v[1] for v in kernels.values()) / n
            per[variant] = (statistics.median(walls), count, gpu, guards)
            records.append(dict(model=args.model, mode=mode, batch=int(batch), phase=phase,
                                variant=variant, wall_ms=walls, host_ms=hosts, kernels=count,
                                gpu_us=gpu,
                                guards=guards and guards[0], guard_us=guards and guards[1]))
            print(f"\n### {args.model} {mode} batch {batch} {phase}, {variant}: "
                  f"{statistics.median(walls):.3f} ms/step (host {statistics.median(hosts):.3f} "
                  f"until the forward returned), {count:.0f} kernels, "
                  f"GPU {gpu:.1f} µs per step"
                  + (f", guards {guards[0]} evaluated in {guards[1]:.1f} µs" if guards else "")
                  + "\n")
            for name, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:args.top]:
                print(f"- {c / n:4.1f}× {t / n:8.1f} µs `{name}`")
            # replays: both variants' host calls per step (docs/perf-notes.md, lead 5 g)
            if (mode == "compile" and variant == "patched") or mode == "reduce-overhead":
                print("\n```\n" + prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=12 if mode == "compile" else 25,
                    max_name_column_width=50) + "```")
        unpatch(model)
        layer_module._prologue = prologue
        if not {"stock", "patched"} <= set(per):
            continue
        s, q = per["stock"], per["patched"]
        g = f"{s[3][1]:.1f} / {q[3][1]:.1f}" if s[3] else "—"
        free = (f" {per['free'][0]:.3f} ({s[0] / per['free'][0]:.3f}×) |" if "free" in per
                else "")
        rows.append(f"| {mode} | {batch} | {phase} | {s[0]:.3f} | {q[0]:.3f} | "
                    f"{s[0] / q[0]:.3f} | {s[1]:.0f} / {q[1]:.0f} | {s[2]:.1f} / {q[2]:.1f} | "
                    f"{g} |{free}")
    print(f"\n{args.model}, {args.layers} layers, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}\n")
    free = "free" in variants
    print("| mode | batch | phase | stock ms | patched ms | speed-up | kernels stock / patched "
          "| GPU µs stock / patched | guards µs stock / patched |"
          + (" free ms (stock ÷ free) |" if free else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if free else ""))
    print("\n".join(rows))
    if args.json:
        env = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                   layers=args.layers)
        with open(args.json, "w") as f:
            json.dump([{**r, **env} for r in records], f, indent=1)
    return 0


def _guard_us(stepper, i: int, calls: int = 500):
    """``(guards, µs)``: how many guards the compiled step checks before every call, and how
    long checking them takes alone (median of 20 runs of ``calls``): the host time of a step
    that is guards, CUDA-graph replays included (docs/perf-notes.md, lead 5 h)."""
    kw = dict(stepper.kw)
    if stepper.phase == "decode":
        tok = stepper.stream[:, PROMPT + i:PROMPT + i + 1]
        kw["position_ids"] = torch.full((tok.shape[0], 1), PROMPT + i, device=tok.device)
    else:
        tok = stepper.stream
    with torch.no_grad():
        found = step_guards(stepper.forward, tok, **kw)
        if found is None:
            return None
        manager, frame = found
        runs = []
        for _ in range(20):
            t0 = time.perf_counter()
            for _ in range(calls):
                manager.check(frame)
            runs.append((time.perf_counter() - t0) / calls * 1e6)
        return manager.check_verbose(frame).num_guards_executed, statistics.median(runs)


def _free_prologue(self, static, state, query, key, value, cache):
    """The ``free`` variant's stand-in for the patched layer's prologue: q and k as
    projected, no norm, no rotary, no bookkeeping; the new K/V rows copied into the cache's
    first rows (a write any prologue must do, here without its addressing: a compiled graph
    keeps the K/V projections only if their results are stored). The first call of a layer,
    before the cache exists, takes the stock update. Wrong logits, on purpose: timing only,
    the floor of what a norm + rotary + cache write can cost in the patched layer."""
    layers = getattr(cache, "layers", None)
    if layers is not None and getattr(layers[self.layer_idx], "is_initialized", False):
        layer, seq_len = layers[self.layer_idx], key.shape[2]
        layer.keys[:, :, :seq_len].copy_(key)
        layer.values[:, :, :seq_len].copy_(value)
        return query, key, layer.keys, layer.values
    return query, key, None, None


class _StepAt:
    """A stepper whose step i is the cell's (decode: token i; prefill: always the prompt)."""

    def __init__(self, stepper, at):
        self.stepper, self.at = stepper, at

    def step(self, i):
        return self.stepper.step(self.at(i))


if __name__ == "__main__":
    sys.exit(main())
