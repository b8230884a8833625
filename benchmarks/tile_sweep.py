"""Which tile shape (heads x tokens per program, warps) is fastest per workload, and what a
patched kernel (e.g. without trig) would gain: GPU time with the SPEC §3 protocol (CUPTI, L2
flushed before every call, median) of forced tile configs and kernel variants, the tool behind
docs/design.md's tile rule and libdevice trig figures.

    python benchmarks/tile_sweep.py                                  # default rows and tiles
    python benchmarks/tile_sweep.py --rows 2,1 --configs 1,1,1,1 2,1,1,1 --rounds 3
    python benchmarks/tile_sweep.py --rows 3,6,8 --configs pick --variants production,trig_hw
    python benchmarks/tile_sweep.py --rows 1:0:1 --check-only       # no GPU: the interpreter
    python benchmarks/tile_sweep.py --model qwen3.5-27b --rows 8:0:1 --configs pick 1,1,1,1
    python benchmarks/tile_sweep.py --rows 1,3,4 --kv-dtype int8 --kv-scales per-token-head

Rows: suite numbers 1-13, paged p1-p3, or S:C:B. Each candidate (config x variant) goes through
the production launch (``launcher.launch``, Triton's public launch) with ``pick_config``'s
answer replaced by the candidate's tile ("pick" keeps it); variants are kernel.py with text
substituted (benchmarks/variants.py), loaded as a separate module: nothing of them
lives in src/. Every candidate is first checked against the reference (query/key outputs and
the written cache rows, SPEC §2 rule at the row's atol); probes that drop work are expected to
fail it. Rounds alternate the candidates; per candidate the median of all its calls is
reported. ``--kv-dtype``, ``--kv-scales`` and ``--q-out`` are ``qkrope bench``'s quantised
modes (bench/quant.py: the same scales, checked after dequantisation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qkrope  # noqa: E402
from _common import (  # noqa: E402
    forced, launch_args, parse_config, parse_rows, require_cuda, row_inputs, row_options,
)
from variants import VARIANTS, variant_kernel  # noqa: E402
from qkrope._interpret import interpreting  # noqa: E402
from qkrope.bench import quant as quant_modes  # noqa: E402
from qkrope.ops.qknorm_rope import launcher  # noqa: E402
from qkrope.ops.qknorm_rope.checks import NORM_ROUNDINGS, scalar_on  # noqa: E402
from qkrope.suite import DEFAULT_MODEL, MODELS, check_outputs  # noqa: E402

DEFAULT_CONFIGS = ["pick", "1,1,1,1", "2,1,1,1", "2,2,1,1", "8,8,1,2", "16,8,1,2", "32,8,1,4",
                   "16,8,2,2"]


def written_rows(row, outs):
    """``(query_rotated, key_rotated, written K rows, written V rows)`` of one call's outputs
    (the caches are compared only where the call writes: they are up to GBs)."""
    q, k, kc, vc, args = outs
    rows = args[6]
    if row.paged:  # [blocks, block_size, Hkv, D] -> the slots' rows
        flat = lambda c: c.reshape(-1, *c.shape[2:])[rows]  # noqa: E731
    else:
        flat = lambda c: c[:, :, rows]  # noqa: E731
    return q, k, flat(kc), flat(vc)


def outputs_of(args, quant):
    """``(query_out, key_out, launch keywords, dequantisation keywords)`` for a launch on
    ``args`` in mode ``quant``: fresh output buffers and scale caches, static scales on the
    device as the public entry points pass them."""
    kw = quant.call_kwargs(args)
    q_out = kw.get("query_out", torch.empty_like(args[0]))
    scales = {k: scalar_on(v, args[0].device) if isinstance(v, float) else v
              for k, v in kw.items() if k != "query_out"}
    return q_out, torch.empty_like(args[1]), scales, kw


def check(row, args, want, kernel, config, opts, quant) -> str:
    """One call of the candidate on fresh copies of the caches, against the reference's
    ``want`` (:func:`written_rows`, dequantised): "ok", "WRONG", or "FAILED: why" (a tile or
    variant that does not compile or launch)."""
    kc, vc = args[4].clone(), args[5].clone()
    mine = (*args[:4], kc, vc, *args[6:])
    q_out, k_out, scales, kw = outputs_of(mine, quant)
    try:
        with forced(kernel=kernel, config=config):
            launcher.launch(*launch_args(mine, q_out, k_out, opts, **scales))
    except Exception as e:  # reported in the table; the other candidates still run
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    got = written_rows(row, (*quant.dequantize((q_out, k_out, kc, vc), kw), args))
    return "ok" if all(c.ok for c in check_outputs(got, want, row.workload.atol)) else "WRONG"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", "--workloads", default="1,2,3,5,13",
                   help="suite numbers 1-13, paged p1-p3, or S:C:B (default: 1,2,3,5,13)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="HQ,HKV,T,WARPS",
                   help="BLOCK_HQ,BLOCK_HKV,BLOCK_T,num_warps (powers of two), or 'pick': "
                        "pick_config's choice for the row")
    p.add_argument("--variants", default="production",
                   help=f"comma-separated kernels: production, {', '.join(VARIANTS)}")
    p.add_argument("--iters", type=int, default=30, help="timed calls per candidate and round")
    p.add_argument("--rounds", type=int, default=1, help="rounds, candidates alternating")
    p.add_argument("--cache-len", type=int, default=None,
                   help="cache rows L of [B, H, S, D] rows (default: the model's 262144 on a GPU, "
                        "as the suite run; C+S without one; paged rows size their own)")
    p.add_argument("--check-only", action="store_true",
                   help="check every candidate against the reference, time nothing (runs in "
                        "Triton's interpreter without a GPU: keep the rows tiny; variants patch "
                        "only the GPU code path, so there they pass like production)")
    p.add_argument("--model", default=DEFAULT_MODEL.name, choices=sorted(MODELS),
                   help="head geometry of the rows (default: the suite's 96/8/128)")
    p.add_argument("--norm-rounding", default="weight_fp32", choices=NORM_ROUNDINGS,
                   help="the op's norm_rounding (hf: the HF integration's Qwen3 rounding)")
    p.add_argument("--json", metavar="PATH", help="write every timed call here")
    quant_modes.add_arguments(p)
    args = p.parse_args()
    model = MODELS[args.model]
    try:
        quant = quant_modes.Quant.from_args(args)
        rows = parse_rows(args.rows)
        configs = [(text, None if text == "pick" else parse_config(text))
                   for text in args.configs]
    except ValueError as e:
        p.error(str(e))
    variants = args.variants.split(",")
    for v in variants:
        if v != "production" and v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: production, {', '.join(VARIANTS)}")
    if not args.check_only:
        require_cuda("tile_sweep.py (timing; --check-only runs the checks without a GPU)")
    kernels = {v: variant_kernel(v) for v in variants}
    candidates = [(f"{text}" + ("" if v == "production" else f"/{v}"), cfg, kernels[v])
                  for v in variants for text, cfg in configs]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    if args.check_only:
        print(f"checking on {device}{' (Triton interpreter)' if interpreting() else ''}")
    else:
        from qkrope.bench.timing import L2Flusher, copy_bandwidth, cupti_call_times_us

        bw, flush = copy_bandwidth(), L2Flusher()
        print(f"{torch.cuda.get_device_name()} | {model.name} ({model.num_q_heads}/"
              f"{model.num_kv_heads}/{model.head_dim}) | copy bandwidth {bw / 1e12:.2f} TB/s | "
              f"{args.rounds} round(s) x {args.iters} calls, candidates alternating")
    if quant.active:
        print(f"quantised mode: {quant.describe()}")
    for v in variants:
        if v != "production":
            print(f"variant {v}: {VARIANTS[v][0]}")
    log = {}
    for row in rows:
        w = row.workload
        cache_len = None if row.paged else args.cache_len or (
            model.max_position_embeddings if device == "cuda" else w.cache_len + w.seq_len)
        g = torch.Generator(device=device).manual_seed(0)
        a = quant.prepare(row_inputs(row, device=device, generator=g, cache_capacity=cache_len,
                                     geometry=model))
        reference = qkrope.reference_paged if row.paged else qkrope.reference
        # the model's partial rotary and (1 + w) norms, and the norm rounding asked for
        fields = dict(model.options(), norm_rounding=args.norm_rounding)
        opts = row_options(row, **fields)
        kw = quant.call_kwargs(a)
        want = written_rows(row, (*quant.dequantize(
            reference(*a, inplace=False, **fields, **kw), kw), a))
        ok = {name: check(row, a, want, kernel, cfg, opts, quant)
              for name, cfg, kernel in candidates}
        del want
        if args.check_only:
            print(f"{row.label} {w.name}: " + "  ".join(
                f"({name})={status}" for name, status in ok.items()))
            continue
        q_out, k_out, scales, _ = outputs_of(a, quant)
        # The tile production launch() picks for this call (its own inputs, not a copy of them)
        captured = []
        with forced(capture=captured):
            launcher.launch(*launch_args(a, q_out, k_out, opts, **scales))
        meta = captured[0][2]
        pick = (meta["BLOCK_HQ"], meta["BLOCK_HKV"], meta["BLOCK_T"], meta["num_warps"])
        runnable = [c for c in candidates if not ok[c[0]].startswith("FAILED")]
        times = {name: [] for name, _, _ in runnable}
        for _ in range(args.rounds):
            for name, cfg, kernel in runnable:
                def call(cfg=cfg, kernel=kernel, call_args=launch_args(a, q_out, k_out, opts,
                                                                       **scales)):
                    with forced(kernel=kernel, config=cfg):
                        launcher.launch(*call_args)
                times[name] += cupti_call_times_us(call, flush, iters=args.iters)
        med = sorted((statistics.median(t), name) for name, t in times.items())
        print(f"#{row.label} {w.name} floor {quant.bytes_moved(w, model) / bw * 1e6:.2f} µs, "
              f"pick_config {pick}: "
              + "  ".join(f"({name})={t:.2f}{'' if ok[name] == 'ok' else ' WRONG'}"
                          for t, name in med)
              + "".join(f"  ({name}) {ok[name]}" for name, _, _ in candidates
                        if name not in times), flush=True)
        log[row.label] = dict(pick=pick, correct=ok, times=times)
        del a, q_out, k_out, scales
        torch.cuda.empty_cache()
    if args.json and log:
        with open(args.json, "w") as f:
            json.dump(log, f)


if __name__ == "__main__":
    main()
