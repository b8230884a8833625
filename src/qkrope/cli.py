"""The ``qkrope`` command (also ``python -m qkrope``): ``bench``, ``info``, ``build-native``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .bench import quant
from .bench.e2e import MODES, PHASES, PRESETS, STEPS
from .bench.runner import NATIVE_WAIT_S, InputsTooLarge, ProgressBar, sweep_workloads
from .suite import (
    MODELS, PAGED_SUITE, REDUCED_MAX_BATCH, REDUCED_MAX_SEQ, SUITE, Workload, reduced_geometry,
)

# Exit statuses beyond 0/1: argparse's own for usage errors, the shell's for SIGINT.
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A request the command cannot honour, found before any work (exit status 2)."""


DESCRIPTION = """\
qkrope: fused QK-norm + RoPE + KV-cache-write GPU kernels for Qwen3-style attention.
Run `qkrope COMMAND --help` for the options of each command."""

WORKLOADS_TEXT = """\
A workload is S,C,B: S new tokens per sequence (S = 1 is a decode step, larger S a prefill),
written after C tokens already in the KV cache (so the new tokens sit at positions C .. C+S-1),
for a batch of B sequences. Each workload has its own absolute tolerance atol."""

_S, _B = REDUCED_MAX_SEQ, REDUCED_MAX_BATCH
_REDUCED_EXAMPLE = "96/8 becomes {0.num_q_heads}/{0.num_kv_heads}".format(
    reduced_geometry(MODELS["qwen3-coder-480b"]))

BENCH_DESCRIPTION = f"""\
Check every implementation against qkrope.reference (the op in plain PyTorch, with the same
bf16 rounding points) and, on a CUDA GPU, time it.

{WORKLOADS_TEXT}

The suite is 13 such workloads for Qwen3-Coder-480B's heads (96 query, 8 key/value, head_dim
128), from a single decode token to a 4096-token prefill after 2048 cached tokens:
  {" ".join(f"{w.seq_len},{w.cache_len},{w.batch}" for w in SUITE)}
(`qkrope bench --list` prints it as a table, with the tolerances and the implementations).

Correctness rule: an output element matches when |out - ref| <= atol + 0.05 * |ref|; a workload
passes when at least 99% of the elements of each of the four outputs (rotated query, rotated
key, key cache, value cache) match and none is NaN or Inf.

Timing protocol (GPU): the GPU time of each call's kernels from CUPTI records (first kernel
start to last kernel end), the L2 cache flushed before every call, 10 warm-up calls, the median
of 50, and the geometric mean over the suite; beside it, host time per eager call and per call
in a replayed CUDA graph, and the bandwidth floor: the bytes a call must move divided by the
device-to-device copy bandwidth measured in the same run.

Without a CUDA GPU nothing is timed: qkrope's Triton kernel is checked through Triton's CPU
interpreter at reduced sizes. Each workload keeps its shape class (its C and atol, decode or
prefill, S modulo {_S}): S over {_S} becomes {_S} + S mod {_S}, B over {_B} becomes {_B}, and the
heads shrink ({_REDUCED_EXAMPLE}; head_dim kept). This takes seconds; --full checks the full sizes
(a minute or two on two cores)."""

BENCH_EPILOG = f"""\
exit status: 0 when every qkrope check passes (a failing peer is only reported), 1 when a
qkrope output is wrong or its call fails, or a workload's inputs cannot be allocated,
{EXIT_USAGE} for a request that cannot be honoured (checked before any work, a cache too big
for this machine's memory included), {EXIT_INTERRUPTED} when interrupted (Ctrl-C; --json keeps
the partial results)."""


def _shape(text: str) -> Workload:
    try:
        s, c, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants S,C,B (three integers), got {text!r}")
    if s < 1 or c < 0 or b < 1:
        raise argparse.ArgumentTypeError(f"--shape needs S >= 1, C >= 0, B >= 1, got {text!r}")
    return Workload(s, c, b)


def _positive_int(text: str) -> int:
    values = _int_list(text, "a positive integer")
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}")
    return values[0]


def _seconds(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        t = -1.0
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"wants seconds (a number >= 0), got {text!r}")
    return t


def _int_list(text: str, what: str = "comma-separated positive integers") -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"wants {what}, got {text!r}")
    return values


def _choice_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values or any(v not in choices for v in values):
            raise argparse.ArgumentTypeError(f"wants a comma-separated list of "
                                             f"{', '.join(choices)}, got {text!r}")
        return values
    return parse


#: The seeds a torch.Generator takes (manual_seed overflows past them).
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1


def _seed(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants an integer, got {text!r}")
    if not SEED_MIN <= n <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"wants an integer from -2**63 to 2**64 - 1 (the "
                                         f"seeds torch's generator takes), got {text}")
    return n


def _version_line() -> str:
    import torch
    import triton

    from . import __version__

    return f"qkrope {__version__} (torch {torch.__version__}, triton {triton.__version__})"


def _impl_help() -> str:
    from .bench.impls import ALL_IMPLS

    names = "; ".join(f"{n}: {i.description}" for n, i in ALL_IMPLS.items())
    return ("comma-separated implementations to compare (" + names + "). Default: every one "
            "that can run here (a peer whose package is missing is left out); without a CUDA "
            "GPU only qkrope, as nothing is timed there. Naming one that cannot run reports "
            "it as skipped, with the reason")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="qkrope", description=DESCRIPTION, formatter_class=raw)
    parser.add_argument("--version", action="version", version=_version_line(),
                        help="print the versions of qkrope, torch and triton, and exit")
    sub = parser.add_subparsers(title="commands", dest="command", required=True,
                                metavar="COMMAND")

    b = sub.add_parser("bench", help="check qkrope and its peers against the reference on the "
                                    "13-workload suite; time them on a CUDA GPU",
                       description=BENCH_DESCRIPTION, epilog=BENCH_EPILOG, formatter_class=raw)
    b.add_argument("--list", action="store_true",
                   help="print the suite's workloads and the implementations, and exit")
    b.add_argument("--impl", metavar="NAMES", default=None, help=_impl_help())
    b.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="head geometry and RoPE constants: "
                        + ", ".join(f"{m.name} {m.num_q_heads}/{m.num_kv_heads}/{m.head_dim}"
                                    for m in MODELS.values())
                        + " (query/key-value heads/head_dim; default: qwen3-coder-480b)")
    b.add_argument("--shape", type=_shape, action="append", metavar="S,C,B",
                   help="a workload of your own instead of the suite: S new tokens per "
                        "sequence after C cached tokens, B sequences (repeatable; atol 1e-5)")
    b.add_argument("--sweep", action="store_true",
                   help="prefill lengths 1..16384 (C=0, B=1) and decode batches 2..4096 (S=1, "
                        "C=511) instead of the suite")
    b.add_argument("--layout", choices=("bhsd", "paged"), default="bhsd",
                   help="bhsd: the [B, H, S, D] op on the 13-workload suite (default); paged: "
                        "the token-major op with a paged cache on decode batches of 64 and 256 "
                        "sequences at mixed positions and a 4096-token prefill, against the "
                        "unfused serving sequence")
    b.add_argument("--full", action="store_true",
                   help="without a CUDA GPU, check the full sizes instead of the reduced ones "
                        "(a minute or two on 2 cores in Triton's interpreter); a GPU always "
                        "runs full sizes")
    b.add_argument("--iters", type=_positive_int, default=50, metavar="N",
                   help="timed calls per measurement (default 50)")
    b.add_argument("--warmup", type=_positive_int, default=10, metavar="N",
                   help="warm-up calls before each measurement (default 10)")
    b.add_argument("--host-calls", type=_positive_int, default=2000, metavar="N",
                   help="back-to-back calls for the host time per eager call (default 2000)")
    b.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timing")
    b.add_argument("--cache-len", type=_positive_int, default=None, metavar="L",
                   help="cache length L of every workload (default: the model's max positions "
                        "for the suite on a GPU, as the suite specifies, else C+S per workload)")
    b.add_argument("--benchmark-inputs", action="store_true",
                   help="all-ones norm weights, as the public benchmark uses (default: random "
                        "weights, so a kernel that ignored them would fail)")
    b.add_argument("--seed", type=_seed, default=0, metavar="N",
                   help="seed of the random inputs (q, k, v, caches, norm weights; default 0)")
    b.add_argument("--native-wait", type=_seconds, default=NATIVE_WAIT_S, metavar="SECONDS",
                   help="on a GPU, how long to wait for the native launch helpers to finish "
                        f"building before timing (default {NATIVE_WAIT_S:g}; 0: don't wait); "
                        "the route timed is printed. Never waits without a GPU")
    b.add_argument("--json", metavar="PATH",
                   help="write every number and the environment to PATH (rewritten after every "
                        "workload, so an interrupted run keeps its partial results)")
    b.add_argument("--plot", metavar="PATH",
                   help="write a PNG of latency vs tokens with the bandwidth floor (needs "
                        "matplotlib; without a CUDA GPU nothing is timed, so no plot is "
                        "written, and the rest of the run goes ahead)")

    quant.add_arguments(b)
    e = b.add_argument_group(
        "end to end (--e2e)",
        "A Qwen3-family model (random weights, a few layers at a preset's width), stock vs "
        "patched (each in worker processes of its own), decode step and prefill, in four "
        "modes; wall ms per step, host time included, with a correctness column and graph "
        "counts (qkrope.bench.e2e). --model picks one preset (default: all); --json, --plot, "
        "--seed, --native-wait apply.")
    e.add_argument("--e2e", action="store_true",
                   help="run the end-to-end model benchmark instead of the op suite")
    e.add_argument("--batch", type=_int_list, default=None, metavar="B,...",
                   help="batches (default 1,8,64 on a GPU, 1,2 without)")
    e.add_argument("--modes", type=_choice_list(MODES), default=None, metavar="M,...",
                   help=f"modes, of {','.join(MODES)} (default: all)")
    e.add_argument("--phases", type=_choice_list(PHASES), default=None, metavar="P,...",
                   help=f"phases, of {','.join(PHASES)} (default: both)")
    e.add_argument("--layers", type=_positive_int, default=4, metavar="N",
                   help="decoder layers of the model (default 4; 2 without a GPU)")
    e.add_argument("--steps", type=_positive_int, default=STEPS, metavar="N",
                   help="timed decode steps (prefills: N // 3, from 4 to 20) after 5 warm-up "
                        f"steps (default {STEPS}; 3 after 2 without a GPU)")
    e.add_argument("--prefill-len", type=_positive_int, default=512, metavar="S",
                   help="prefill tokens per sequence (default 512; 24 without a GPU)")
    e.add_argument("--processes", type=_positive_int, default=None, metavar="N",
                   help="worker processes per variant, timed in turn, their times pooled: "
                        "a process's host runs at a speed of its own (default 2 on a GPU, "
                        "1 without)")
    e.add_argument("--rescore", metavar="PATH",
                   help="run nothing: read a --json file of an earlier --e2e run and print "
                        "its table with this version's statistics, from its stored step times "
                        "(--json, --plot write it again)")

    i = sub.add_parser("info", help="versions, GPU, Triton interpreter state and which launch "
                                        "route is active, and why",
                       description="Print qkrope, Python, torch, Triton and CUDA versions, the "
                                   "GPUs, whether Triton's interpreter is on, and which launch "
                                   "route repeated eager calls take and why, as key: value lines.")
    i.add_argument("--json", action="store_true", help="print the same as one JSON object")

    n = sub.add_parser("build-native", help="build the eager fast path's C++ launch helpers now "
                                               "and print their path, or why not",
                       description="Build (or load from torch's extension cache) the C++ helpers "
                                   "the eager fast path launches kernels with; normally they "
                                   "build in the background on the first GPU launch. Prints the "
                                   "module's path, or why it could not be built. Exit status 0 "
                                   "when built, 1 when not.")
    n.add_argument("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="give up waiting after this long (default 600; a first build takes "
                        "~20 s on two cores)")
    return parser


# ----------------------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------------------
def _bench_list() -> int:
    import torch

    from .bench.impls import ALL_IMPLS, impl_layouts

    timed = torch.cuda.is_available()
    print(WORKLOADS_TEXT)
    for title, suite in (("The suite (--layout bhsd)", SUITE),
                         ("The paged suite (--layout paged; B sequences of one token each in "
                          "decode)", PAGED_SUITE)):
        print(f"\n{title}:")
        print(f"{'#':>3} {'S':>5} {'C':>5} {'B':>4} {'tokens':>6}  atol")
        for k, w in enumerate(suite, 1):
            print(f"{k:>3} {w.seq_len:>5} {w.cache_len:>5} {w.batch:>4} {w.tokens:>6}  "
                  f"{w.atol:g}")
    print("\nImplementations (--impl):")
    for name, impl in ALL_IMPLS.items():
        # Why not on this machine (e.g. a missing package), asked of a layout that has it.
        why = impl.unavailable()
        if why is None and not timed and name != "qkrope":
            why = "checked and timed only on a CUDA GPU"
        layouts = "/".join(impl_layouts(name))
        state = "runs here" if why is None else f"not here: {why}"
        print(f"  {name:<14} {impl.description} [{layouts}; {state}]")
    return 0


def _workloads(args) -> list[Workload]:
    """The workloads a bench request runs: its --shape list, the --sweep, or the layout's suite."""
    if args.shape:
        return args.shape
    if args.sweep:
        return sweep_workloads()
    return list(PAGED_SUITE if args.layout == "paged" else SUITE)


def _check_paths(args, timed: bool) -> None:
    """--json and --plot name files whose folder exists, and a plot that will be drawn has
    matplotlib (checked before any work). Without a GPU nothing is timed, so nothing is
    plotted: the run (and --json) goes ahead and says so at the end."""
    for opt, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise UsageError(f"{opt} {path}: folder {folder} does not exist")
        if path and os.path.isdir(path):
            raise UsageError(f"{opt} {path}: is a folder; give a file name")
    if args.plot and timed:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'qkrope[plot]' (or drop "
                             "--plot)") from None


def _check_requests(args, timed: bool, workloads: list[Workload]) -> list[str]:
    """Everything a request needs that can be known before any work; returns the impl list."""
    from .bench.impls import ALL_IMPLS, default_impls

    if args.impl is None:
        impls = default_impls(args.layout, timed)
    else:
        impls = [s.strip() for s in args.impl.split(",") if s.strip()]
        unknown = [n for n in impls if n not in ALL_IMPLS]
        if unknown:
            raise UsageError(f"--impl: unknown implementation {', '.join(map(repr, unknown))}; "
                             f"choose from {', '.join(ALL_IMPLS)}")
        if not impls:
            raise UsageError("--impl: no implementation named")
    _check_paths(args, timed)
    if args.cache_len is not None:
        from .suite import cache_rows_needed

        for w in workloads:
            need = cache_rows_needed(w, args.layout)
            if args.cache_len < need:
                raise UsageError(f"--cache-len {args.cache_len}: workload {w.seq_len},"
                                 f"{w.cache_len},{w.batch} needs a cache of at least {need} rows")
    return impls


def _check_memory(args, plan, cache_len: int | None, timed: bool) -> None:
    """Refuses, before any work, a workload whose inputs cannot fit in this machine's memory
    (the GPU's, or without one its RAM), saying what it needs and what to shrink."""
    from .bench.runner import human_size, inputs_size, memory_bytes

    have = memory_bytes()
    if have is None:
        return
    for listed, checked in plan.workloads:
        size = inputs_size(checked, plan.geometry, args.layout, cache_len)
        if size.total_bytes > have:
            how = ("a smaller --cache-len" if args.cache_len is not None else
                   "a smaller C or B in --shape" if args.shape else "a smaller --cache-len")
            raise UsageError(f"workload {listed.seq_len},{listed.cache_len},{listed.batch} needs "
                             f"{size.describe()}, more than this machine's {human_size(have)} of "
                             f"{'GPU memory' if timed else 'memory'}: use {how}")


def _bench_e2e(args) -> int:
    import torch
    from rich.console import Console

    from .bench.e2e import read_e2e_json, run_command

    if args.model is not None and args.model not in PRESETS:
        raise UsageError(f"--e2e --model: one of {', '.join(PRESETS)}, got {args.model!r}")
    if args.shape or args.sweep or args.layout != "bhsd" or args.impl:
        raise UsageError("--e2e runs whole models: --shape, --sweep, --layout and --impl do "
                         "not apply")
    if args.rescore:
        run = [opt for opt, given in (
            ("--model", args.model is not None), ("--batch", args.batch is not None),
            ("--modes", args.modes is not None), ("--phases", args.phases is not None),
            ("--layers", args.layers != 4), ("--steps", args.steps != STEPS),
            ("--prefill-len", args.prefill_len != 512),
            ("--processes", args.processes is not None)) if given]
        if run:
            raise UsageError(f"--rescore reads a finished run: {', '.join(run)} do not apply")
        if not os.path.isfile(args.rescore):
            raise UsageError(f"--rescore {args.rescore}: no such file")
        try:
            saved = read_e2e_json(args.rescore)
        except ValueError as e:
            raise UsageError(f"--rescore {args.rescore}: {e}") from None
        _check_paths(args, saved.timed)
        return run_command(args, Console(stderr=True), None, saved)
    _check_paths(args, torch.cuda.is_available())
    err = Console(stderr=True)
    return run_command(args, err, ProgressBar(err))


def _bench(args) -> int:
    if args.list:
        return _bench_list()
    if args.e2e or args.rescore:
        return _bench_e2e(args)
    args.model = args.model or "qwen3-coder-480b"
    import torch
    from rich.console import Console

    from .bench import check_plan, render_markdown, run_benchmark, write_json

    err = Console(stderr=True)
    timed = torch.cuda.is_available()
    if args.shape and args.sweep:
        raise UsageError("--shape and --sweep both choose the workloads: give one")
    workloads = _workloads(args)
    impls = _check_requests(args, timed, workloads)
    try:
        mode = quant.Quant.from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    geometry = MODELS[args.model]
    cache_len = args.cache_len
    if (cache_len is None and timed and not (args.shape or args.sweep)
            and args.layout == "bhsd"):
        cache_len = geometry.max_position_embeddings
    plan = check_plan(workloads, geometry, reduced=not timed and not args.full)
    _check_memory(args, plan, cache_len, timed)
    if not timed:
        err.print("No CUDA device: checking qkrope's kernel through Triton's interpreter at "
                  f"{plan.describe(geometry)}. Timing needs a CUDA GPU.", highlight=False,
                  markup=False)

    written = []

    def keep(report) -> None:
        if args.json:
            write_json(report, args.json)
            written[:] = [args.json]

    try:
        with ProgressBar(err) as bar:
            report = run_benchmark(
                workloads, geometry, impls, iters=args.iters, warmup=args.warmup,
                host_calls=args.host_calls, graphs=not args.no_graph,
                benchmark_inputs=args.benchmark_inputs, cache_capacity=cache_len,
                seed=args.seed, progress=bar, layout=args.layout, full_size=args.full,
                native_wait_s=args.native_wait, on_update=keep, quant=mode)
    except KeyboardInterrupt:
        where = (f"; partial results written to {written[0]}" if written else
                 f"; nothing written to {args.json} yet" if args.json else "")
        print(f"interrupted{where}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except InputsTooLarge as e:  # memory taken since the check before the run
        where = f"; partial results written to {written[0]}" if written else ""
        print(f"qkrope bench: error: {e}{where}", file=sys.stderr)
        return 1
    keep(report)
    print(render_markdown(report))
    if args.json:
        err.print(f"wrote {args.json}", highlight=False, markup=False)
    if args.plot and report.timed:
        from .bench import write_plot

        write_plot(report, args.plot)
        err.print(f"wrote {args.plot}", highlight=False, markup=False)
    elif args.plot:
        err.print(f"--plot: {args.plot} not written: it draws timings, and timing needs a CUDA "
                  "GPU", highlight=False, markup=False)
    # A wrong qkrope result fails the command; a failing peer is only reported.
    ours = [w.impls["qkrope"] for w in report.workloads if "qkrope" in w.impls]
    return 1 if any(r.correct is False or r.error for r in ours) else 0


# ----------------------------------------------------------------------------------------------
# info, build-native
# ----------------------------------------------------------------------------------------------
def _info(args) -> int:
    from .bench.env import INFO_LABELS, collect_info

    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    for key, value in info.items():
        if key == "gpus":
            if not value:
                print(f"{INFO_LABELS[key]}: none")
            for k, gpu in enumerate(value):
                print(f"{INFO_LABELS[key]} {k}: {gpu}")
        elif isinstance(value, dict):
            for sub, v in value.items():
                print(f"{key} {sub}: {v}")
        else:
            print(f"{INFO_LABELS.get(key, key)}: {value}")
    return 0


def _build_native(args) -> int:
    from .ops import _native

    ok, message = _native.build(args.timeout)
    print(f"native launch helpers: {'built' if ok else 'not built'}: {message}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"bench": _bench, "info": _info, "build-native": _build_native}
    try:
        return commands[args.command](args)
    except UsageError as e:
        print(f"qkrope {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
