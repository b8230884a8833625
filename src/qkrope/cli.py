"""Command line: ``qkrope bench`` (also ``python -m qkrope bench``)."""

from __future__ import annotations

import argparse
import sys

from .suite import MODELS, PAGED_SUITE, SUITE, Workload

DEFAULT_IMPLS = "qkrope,torch.compile,eager,liger,flashinfer"


def _shape(text: str) -> Workload:
    try:
        s, c, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants S,C,B (three integers), got {text!r}")
    if s < 1 or c < 0 or b < 1:
        raise argparse.ArgumentTypeError(f"--shape needs S >= 1, C >= 0, B >= 1, got {text!r}")
    return Workload(s, c, b)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qkrope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench", help="check and time the op on the 13-workload suite (SPEC.md §2-§4)",
        description="Check every implementation against qkrope.reference with the SPEC §2 rule "
                    "and time it with the SPEC §3 protocol (CUPTI GPU time, L2 flushed before "
                    "every call, warm-ups, median). Without CUDA: checks the real kernel "
                    "through Triton's interpreter and exits 0.")
    b.add_argument("--impl", default=DEFAULT_IMPLS,
                   help=f"comma-separated implementations (default: {DEFAULT_IMPLS})")
    b.add_argument("--model", choices=sorted(MODELS), default="qwen3-coder-480b",
                   help="head geometry preset (default: qwen3-coder-480b, 96/8/128)")
    b.add_argument("--shape", type=_shape, action="append", metavar="S,C,B",
                   help="custom workload (repeatable) instead of the suite")
    b.add_argument("--sweep", action="store_true",
                   help="prefill lengths 1..16384 and decode batches 2..4096 instead of the suite")
    b.add_argument("--layout", choices=("bhsd", "paged"), default="bhsd",
                   help="bhsd: the [B, H, S, D] op on the 13-workload suite (default); paged: "
                        "the token-major op with a paged NHD cache on decode batches of 64 and "
                        "256 sequences at mixed positions and a 4096-token prefill, against the "
                        "unfused serving sequence")
    b.add_argument("--iters", type=int, default=50, help="timed calls per measurement (50)")
    b.add_argument("--warmup", type=int, default=10, help="warm-up calls (10)")
    b.add_argument("--host-calls", type=int, default=2000,
                   help="back-to-back calls for the host-time figure (2000)")
    b.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    b.add_argument("--cache-len", type=int, default=None,
                   help="cache length L (default: the model's max positions for the suite on a "
                        "GPU, else C+S per workload)")
    b.add_argument("--benchmark-inputs", action="store_true",
                   help="all-ones norm weights, as the public benchmark uses (default: random)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="PATH", help="write every number and the environment")
    b.add_argument("--plot", metavar="PATH", help="write a PNG: latency vs tokens, with the floor")
    return parser


def _bench(args) -> int:
    import torch
    from rich.console import Console

    from .bench import render_markdown, run_benchmark, sweep_workloads, write_json, write_plot

    err = Console(stderr=True)
    geometry = MODELS[args.model]
    if args.shape:
        workloads = args.shape
    elif args.sweep:
        workloads = sweep_workloads()
    else:
        workloads = list(PAGED_SUITE if args.layout == "paged" else SUITE)
    cache_len = args.cache_len
    if (cache_len is None and torch.cuda.is_available() and not (args.shape or args.sweep)
            and args.layout == "bhsd"):
        cache_len = geometry.max_position_embeddings
    if not torch.cuda.is_available():
        err.print("[yellow]No CUDA device: checking the real kernel through Triton's interpreter "
                  "at cache length C+S (this takes a minute or two); timing needs a CUDA GPU."
                  "[/yellow]")
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]

    with err.status("starting") as status:
        report = run_benchmark(
            workloads, geometry, impls, iters=args.iters, warmup=args.warmup,
            host_calls=args.host_calls, graphs=not args.no_graph,
            benchmark_inputs=args.benchmark_inputs, cache_capacity=cache_len, seed=args.seed,
            progress=lambda msg: status.update(f"[bold]qkrope bench[/bold] {msg}"),
            layout=args.layout)
    print(render_markdown(report))
    if args.json:
        write_json(report, args.json)
        err.print(f"wrote {args.json}")
    if args.plot:
        if report.timed:
            write_plot(report, args.plot)
            err.print(f"wrote {args.plot}")
        else:
            err.print("--plot skipped: it needs timings, and timing needs a CUDA GPU")
    # A wrong qkrope result fails the command; a failing baseline is only reported.
    ours = [w.impls["qkrope"] for w in report.workloads if "qkrope" in w.impls]
    return 1 if any(r.correct is False or r.error for r in ours) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
