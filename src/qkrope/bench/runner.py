"""The benchmark's main loop and its outputs: markdown table, JSON and plot.

``run_benchmark`` checks and times every implementation on every workload (GPU), or checks
qkrope through Triton's interpreter on a machine without CUDA, at reduced sizes unless asked
for full ones (:func:`check_plan`). Rendering works on plain result objects, so it is tested
without a GPU.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import triton

from .. import __version__
from ..suite import (
    DEFAULT_MODEL, REDUCED_MAX_BATCH, REDUCED_MAX_SEQ, SUITE, ModelGeometry, Workload,
    bytes_moved, check_outputs, reduced_geometry, reduced_workload,
)
from .impls import LAYOUTS, default_impls, peer_unavailable, resolve_impls, with_fresh_caches

__all__ = ["ImplResult", "WorkloadResult", "BenchReport", "CheckPlan", "Progress", "check_plan",
           "run_benchmark", "render_markdown", "write_json", "write_plot", "sweep_workloads",
           "environment", "NATIVE_WAIT_S", "InputsTooLarge", "inputs_size", "memory_bytes"]

# Vendor datasheet HBM bandwidth (bytes/s) by GPU name, for the "% spec BW" column.
SPEC_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12}

#: How long a GPU run waits for the native launch helpers before timing (a first build takes
#: ~30 s on two cores; a broken toolchain must not hold the run forever).
NATIVE_WAIT_S = 300.0


def spec_bandwidth(gpu_name: str | None) -> float | None:
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if gpu_name and key in gpu_name), None)


@dataclass
class ImplResult:
    correct: bool | None = None
    match_fraction: float | None = None        # worst of the four output tensors
    max_abs_err: float | None = None
    median_us: float | None = None
    p20_us: float | None = None
    p80_us: float | None = None
    host_us: float | None = None
    graph_us: float | None = None
    error: str | None = None
    host_add_ratio: float | None = None        # host_us / x.add_(1), runs alternating


@dataclass
class WorkloadResult:
    index: int
    seq_len: int
    cache_len: int
    batch: int
    atol: float
    tokens: int
    bytes: int
    floor_us: float | None
    impls: dict[str, ImplResult] = field(default_factory=dict)
    copy_us: float | None = None   # the faster plain copy of the same bytes, timed like the op
    # The size actually checked, where a reduced plan cut S or B (None: as listed).
    checked_seq_len: int | None = None
    checked_batch: int | None = None


@dataclass
class BenchReport:
    model: str
    geometry: dict
    timed: bool
    copy_bandwidth: float | None               # bytes/s, read + write, same run
    impls: list[str]
    skipped: dict[str, str]
    add_host_us: float | None                  # torch x.add_(1) host µs per call, same run
    workloads: list[WorkloadResult]
    environment: dict
    settings: dict
    # Head geometry the checks ran at where a reduced plan cut it (None: the model's own).
    checked_geometry: dict | None = None
    complete: bool = True                      # False while running and after an interrupt

    def geomean(self, impl: str) -> float | None:
        return _geomean([w.impls[impl].median_us for w in self.workloads if impl in w.impls])

    def floor_geomean(self) -> float | None:
        return _geomean([w.floor_us for w in self.workloads])

    def copy_geomean(self) -> float | None:
        return _geomean([w.copy_us for w in self.workloads])


def _geomean(xs: list) -> float | None:
    if not xs or any(x is None for x in xs):
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def environment() -> dict:
    from ..ops import _native, launch_route

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "qkrope": __version__, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "command": " ".join(["qkrope"] + sys.argv[1:]),
        "launch_route": launch_route(), "commit": _source_commit(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sms=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None),
                   cuda=torch.version.cuda, driver=_driver_version(),
                   fast_path_helpers=_native.status())
    else:
        env.update(gpu=None, note="no CUDA device: correctness only, through Triton's interpreter")
    return env


def _source_commit() -> str | None:
    """The git commit of the qkrope source that runs (``-dirty`` with uncommitted changes to
    tracked files), or None outside a git checkout: results from a source tree that is not an
    installed release say which code they measured."""
    import subprocess

    src = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except Exception:
        return None


def sweep_workloads(max_tokens: int = 16384, decode_max_batch: int = 4096,
                    decode_cache_len: int = 511) -> list[Workload]:
    """Prefill lengths 1..max_tokens (B=1, C=0) and decode batches 1..decode_max_batch (S=1 at
    position ``decode_cache_len``), powers of two."""
    prefill = [Workload(1 << i, 0, 1) for i in range(max_tokens.bit_length())
               if (1 << i) <= max_tokens]
    decode = [Workload(1, decode_cache_len, 1 << i) for i in range(1, decode_max_batch.bit_length())
              if (1 << i) <= decode_max_batch]
    return prefill + decode


@dataclass(frozen=True)
class CheckPlan:
    """What a run checks: each listed workload with the size it is checked at, and the head
    geometry of the checks."""

    geometry: ModelGeometry
    workloads: tuple[tuple[Workload, Workload], ...]   # (listed, checked)
    reduced: bool

    def describe(self, model: ModelGeometry) -> str:
        """One sentence for the output: what a reduced plan changed."""
        if not self.reduced:
            return "full sizes"
        g, S, B = self.geometry, REDUCED_MAX_SEQ, REDUCED_MAX_BATCH
        return (f"reduced sizes: {g.num_q_heads}/{g.num_kv_heads} heads instead of "
                f"{model.num_q_heads}/{model.num_kv_heads} (head_dim {g.head_dim}, rope theta, "
                f"eps, dtype kept), S over {S} cut to {S} + S mod {S}, B over {B} cut to {B} "
                "(C and atol kept); --full checks the full sizes (a minute or two in the "
                "interpreter)")


def check_plan(workloads: Sequence[Workload], geometry: ModelGeometry,
               reduced: bool) -> CheckPlan:
    """The plan of a run: full sizes, or each workload's shape class at interpreter-sized
    heads, tokens and batch (:func:`qkrope.suite.reduced_workload`, :func:`reduced_geometry`)."""
    if not reduced:
        return CheckPlan(geometry, tuple((w, w) for w in workloads), False)
    return CheckPlan(reduced_geometry(geometry),
                     tuple((w, reduced_workload(w)) for w in workloads), True)


class Progress:
    """What :func:`run_benchmark` reports as it goes; this base ignores it (the CLI draws a
    progress bar)."""

    def start(self, total: float, count: int) -> None:
        """``count`` workloads of ``total`` work (arbitrary units) are about to run."""

    def status(self, text: str) -> None:
        """What runs now."""

    def done(self, amount: float) -> None:
        """One workload finished; it was ``amount`` of the work."""


class InputsTooLarge(RuntimeError):
    """A workload's inputs could not be allocated (the message says what, and how to shrink
    it)."""


@dataclass(frozen=True)
class InputsSize:
    """What one workload's check holds in memory at its peak: the key and value caches (the
    inputs, the oracle's fresh copies and the call's copies: three pairs) and the activations
    with their outputs."""

    cache_shape: tuple[int, ...]
    total_bytes: int

    def describe(self) -> str:
        return (f"about {_size(self.total_bytes)}: key and value caches of "
                f"{list(self.cache_shape)} bfloat16 each, held three times (inputs, the "
                "oracle's result, the call's copy)")


def inputs_size(w: Workload, g: ModelGeometry, layout: str = "bhsd",
                cache_capacity: int | None = None) -> InputsSize:
    """The memory :func:`run_benchmark` needs for workload ``w`` checked at geometry ``g``
    (the same cache length rules as the run)."""
    Hq, Hkv, D, elt = g.num_q_heads, g.num_kv_heads, g.head_dim, 2
    if layout == "paged":
        from ..suite import PAGED_BLOCK_SIZE, cache_rows_needed

        slots = cache_capacity or (64 * w.tokens if w.seq_len == 1
                                   else cache_rows_needed(w, "paged"))
        shape = (-(-slots // PAGED_BLOCK_SIZE), PAGED_BLOCK_SIZE, Hkv, D)
    else:
        shape = (w.batch, Hkv, cache_capacity or w.cache_len + w.seq_len, D)
    cache = math.prod(shape) * elt
    activations = w.tokens * (2 * Hq + 4 * Hkv) * D * elt  # q, k, v, both outputs, reference's
    return InputsSize(shape, 3 * 2 * cache + activations)


def memory_bytes() -> int | None:
    """The memory the inputs live in: the GPU's, or without one the machine's RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _allocation_failed(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _check(out, ref, atol) -> ImplResult:
    checks = check_outputs(out, ref, atol)
    return ImplResult(correct=all(c.ok for c in checks),
                      match_fraction=min(c.match_fraction for c in checks),
                      max_abs_err=max(c.max_abs_err for c in checks))


def _work(w: Workload, g: ModelGeometry, n_impls: int, timed: bool) -> float:
    """Relative cost of one workload, for the progress bar's estimate of the time left."""
    if timed:  # timing dominates: a fixed number of calls per implementation, plus the copies
        return n_impls + 1.0
    # The interpreter's cost grows with every (head, token) row of its power-of-two head tiles.
    rows = triton.next_power_of_2(g.num_q_heads) + triton.next_power_of_2(g.num_kv_heads)
    return (w.tokens + 8) * rows * n_impls + 1.0


def run_benchmark(
    workloads: Sequence[Workload] = SUITE,
    geometry: ModelGeometry = DEFAULT_MODEL,
    impls: Sequence[str] | None = None,
    *,
    iters: int = 50,
    warmup: int = 10,
    host_calls: int = 2000,
    graphs: bool = True,
    benchmark_inputs: bool = False,
    cache_capacity: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    layout: str = "bhsd",
    full_size: bool = False,
    native_wait_s: float = NATIVE_WAIT_S,
    on_update: Callable[[BenchReport], None] | None = None,
) -> BenchReport:
    """Check and (with CUDA) time ``impls`` on ``workloads``.

    ``cache_capacity`` is the cache length L of every workload; None gives each workload the
    smallest cache that holds its rows, ``C + S``. ``layout="paged"`` runs the token-major op
    with a paged cache (:data:`qkrope.suite.PAGED_SUITE` workloads) against the unfused serving
    sequence. Without CUDA only qkrope is checked (the others are only worth running to be
    timed), at reduced sizes unless ``full_size``. ``on_update`` gets the report (``complete``
    False) once before the first workload and after every workload, so a caller can keep
    partial results.
    """
    lay = LAYOUTS[layout]
    timed = torch.cuda.is_available()
    device = "cuda" if timed else "cpu"
    progress = progress or Progress()
    if impls is None:
        impls = default_impls(layout, timed)
    options = geometry.options()
    if timed:
        available, skipped = resolve_impls(list(impls), layout, options)
    else:  # peers are only worth running to be timed: not built, their own reason first
        available, skipped = resolve_impls([n for n in impls if n == "qkrope"], layout, options)
        for name in impls:
            if name != "qkrope":
                skipped[name] = peer_unavailable(name, layout) or (
                    "checked and timed only on a CUDA GPU (without one, only qkrope's kernel is "
                    "checked)")
    plan = check_plan(workloads, geometry, reduced=not timed and not full_size)

    bandwidth = flush = add_host = add_one = None
    if timed:
        from .timing import L2Flusher, copy_bandwidth, host_time_per_call_us

        from ..ops import _native

        # The eager fast path switches to its native helpers once they are built (once per
        # machine, in the background): wait for them, so every host time below measures the
        # same path; bounded, so a stuck compiler costs a slower route, not the run. The
        # route measured is in the report's environment. A no-op with QKROPE_NATIVE=0.
        if _native.enabled() and _native.module() is None and native_wait_s > 0:
            progress.status(f"waiting up to {native_wait_s:.0f} s for the native launch helpers "
                            "(a first build takes ~30 s; QKROPE_NATIVE=0 skips it)")
            _native.load(timeout=native_wait_s)
        progress.status("measuring copy bandwidth and torch's host time per call")
        bandwidth = copy_bandwidth()
        flush = L2Flusher()
        x = torch.zeros(16, device="cuda")
        add_host = host_time_per_call_us(lambda: x.add_(1), host_calls)
        add_one = functools.partial(x.add_, 1)

    report = BenchReport(
        model=geometry.name, geometry=asdict(geometry), timed=timed, copy_bandwidth=bandwidth,
        impls=list(available), skipped=skipped, add_host_us=add_host, workloads=[],
        environment=environment(),
        settings=dict(iters=iters, warmup=warmup, host_calls=host_calls, graphs=graphs,
                      benchmark_inputs=benchmark_inputs, cache_capacity=cache_capacity,
                      seed=seed, layout=layout, plan=plan.describe(geometry)),
        checked_geometry=asdict(plan.geometry) if plan.reduced else None, complete=False)
    notify = on_update or (lambda r: None)
    notify(report)

    g = plan.geometry
    work = [_work(checked, g, len(available), timed) for _, checked in plan.workloads]
    progress.start(sum(work), len(work))
    gen = torch.Generator(device=device).manual_seed(seed)
    for idx, ((listed, w), amount) in enumerate(zip(plan.workloads, work), 1):
        nbytes = bytes_moved(listed, geometry)
        wr = WorkloadResult(idx, listed.seq_len, listed.cache_len, listed.batch, listed.atol,
                            listed.tokens, nbytes, nbytes / bandwidth * 1e6 if bandwidth else None)
        if w != listed:
            wr.checked_seq_len, wr.checked_batch = w.seq_len, w.batch
        if available:
            progress.status(f"#{idx} {listed.name} inputs")
            L = cache_capacity or (None if layout == "paged" else w.cache_len + w.seq_len)
            try:
                args = lay.make_inputs(w, g, device=device, cache_capacity=L, generator=gen,
                                       benchmark_weights=benchmark_inputs)
                ref = lay.reference(args, **options)
            except RuntimeError as e:
                if not _allocation_failed(e):
                    raise
                size = inputs_size(w, g, layout, cache_capacity)
                raise InputsTooLarge(
                    f"workload {listed.seq_len},{listed.cache_len},{listed.batch}: could not "
                    f"allocate its inputs ({size.describe()}): {str(e).splitlines()[0]}; use a "
                    "smaller cache length (--cache-len) or workload (--shape S,C,B)") from None
        if timed:
            from .timing import cupti_call_times_us, same_bytes_copies, summarize

            progress.status(f"#{idx} {w.name} copies")
            wr.copy_us = min(summarize(cupti_call_times_us(copy, flush, iters=iters,
                                                           warmup=warmup)).median
                             for copy in same_bytes_copies(nbytes)[2].values())
        for name, fn in available.items():
            progress.status(f"#{idx} {listed.name} {name}")
            call_args = with_fresh_caches(args)
            try:
                res = _check(fn(*call_args), ref, w.atol)
                if timed:
                    _time_into(res, fn, call_args, flush, iters, warmup, host_calls, graphs,
                               add_one)
            except Exception as e:  # one failing implementation must not end the run
                res = ImplResult(error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
            wr.impls[name] = res
            del call_args
        report.workloads.append(wr)
        if available:
            del args, ref
        if timed:
            torch.cuda.empty_cache()
        progress.done(amount)
        notify(report)

    from ..ops import launch_route

    route_now = launch_route()
    if route_now != report.environment["launch_route"]:
        report.environment["launch_route_at_end"] = route_now
    report.complete = True
    return report


def _time_into(res: ImplResult, fn, args, flush, iters, warmup, host_calls, graphs,
               reference) -> None:
    from .timing import cupti_call_times_us, graph_replay_time_us, host_times_beside_us, summarize

    def call():
        return fn(*args)

    stats = summarize(cupti_call_times_us(call, flush, iters=iters, warmup=warmup))
    res.median_us, res.p20_us, res.p80_us = stats.median, stats.p20, stats.p80
    # Beside x.add_(1), runs alternating: the host's speed drifts within one bench run.
    res.host_us, _, res.host_add_ratio = host_times_beside_us(call, reference, host_calls)
    if graphs:
        try:
            res.graph_us = graph_replay_time_us(call)
        except Exception:  # e.g. a host sync inside the call: not capturable
            torch.cuda.synchronize()
            res.graph_us = None


# ----------------------------------------------------------------------------------------------
# rendering
# ----------------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _status(r: ImplResult | None) -> str:
    if r is None:
        return "—"
    if r.error:
        return "error"
    if r.correct is None:
        return "—"
    return "pass" if r.correct else f"FAIL ({_f(r.match_fraction, '{:.1%}')})"


def render_markdown(report: BenchReport, main: str | None = None) -> str:
    """The report as markdown: the per-workload table, geomeans, host/graph times, notes.
    ``main``: the implementation the others are compared with (qkrope when it ran, else the
    first that did)."""
    if main is None:
        main = "qkrope" if "qkrope" in report.impls or not report.impls else report.impls[0]
    lines = []
    env = report.environment
    layout = report.settings.get("layout", "bhsd")
    lines.append(f"qkrope bench — {env.get('gpu') or 'no CUDA device'} — layout {layout} — "
                 f"model {report.model} "
                 f"({report.geometry['num_q_heads']}/{report.geometry['num_kv_heads']}/"
                 f"{report.geometry['head_dim']}) — torch {env['torch']}, triton {env['triton']}, "
                 f"qkrope {env['qkrope']}"
                 + (f" (commit {env['commit']})" if env.get("commit") else ""))
    if env.get("launch_route"):
        route = f"Launch route: {env['launch_route']}"
        if env.get("launch_route_at_end"):
            route += f"; at the end of the run: {env['launch_route_at_end']}"
        lines.append("")
        lines.append(route + ".")
    if not report.complete:
        lines.append("")
        lines.append(f"Partial results: the run stopped after {len(report.workloads)} "
                     "workload(s).")
    lines.append("")
    others = [n for n in report.impls if n != main]
    if report.timed:
        bw = report.copy_bandwidth
        lines.append(f"Copy bandwidth measured in this run: {bw / 1e12:.2f} TB/s (read + write); "
                     "floor = the bytes a call must move (Q, K read and written; V read; the K "
                     "and V cache rows written; 16 B of indices per token) / that. Times: GPU µs "
                     f"per call (CUPTI, L2 flushed, median of {report.settings['iters']}). "
                     "copy µs: the faster of torch's copy "
                     "and a Triton streaming copy moving the same bytes (half read, half "
                     f"written), timed the same way; % of copy = that / {main} µs.")
        lines.append("")
        spec_bw = spec_bandwidth(env.get("gpu"))
        head = ["#", "S", "C", "B", "tokens", "floor µs", "copy µs", f"{main} µs", "p20–p80",
                "% copy BW", "% of copy", "% spec BW"]
        for o in others:
            head.append(f"{o} µs")
        for o in others:
            head.append(f"× vs {o}")
        head.append("correct")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for w in report.workloads:
            m = w.impls.get(main)
            row = [str(w.index), str(w.seq_len), str(w.cache_len), str(w.batch), str(w.tokens),
                   _f(w.floor_us), _f(w.copy_us)]
            if m and m.median_us:
                row += [_f(m.median_us), f"{m.p20_us:.2f}–{m.p80_us:.2f}",
                        _f(100 * w.floor_us / m.median_us, "{:.0f}%"),
                        _f(w.copy_us and 100 * w.copy_us / m.median_us, "{:.0f}%"),
                        _f(spec_bw and 100 * w.bytes / (m.median_us * 1e-6) / spec_bw, "{:.0f}%")]
            else:
                row += ["—"] * 5
            for o in others:
                row.append(_f(w.impls[o].median_us) if o in w.impls else "—")
            for o in others:
                r = w.impls.get(o)
                ok = m and m.median_us and r and r.median_us
                row.append(_f(r.median_us / m.median_us, "{:.1f}×") if ok else "—")
            row.append(" / ".join(f"{n}: {_status(w.impls.get(n))}" for n in report.impls)
                       if others else _status(m))
            lines.append("| " + " | ".join(row) + " |")
        gm = {n: report.geomean(n) for n in report.impls}
        fg = report.floor_geomean()
        lines.append("")
        lines.append("Geometric mean µs: " + ", ".join(
            [f"floor {_f(fg)}", f"copy of the same bytes {_f(report.copy_geomean())}"]
            + [f"{n} {_f(gm[n])}" for n in report.impls]))
        lines.append("")
        lines.append("Host µs per eager call (wall clock, outputs allocated by the call; "
                     f"{report.settings.get('host_calls', '?')} back-to-back calls in 10 runs "
                     "alternating with runs of torch's `x.add_(1)` on a 16-element tensor: the "
                     "median run, and × add_ = the median ratio of a run to the add_ run before "
                     f"it; add_ alone took {_f(report.add_host_us, '{:.1f}')} µs at the start; "
                     f"qkrope's fast-path helpers: {env.get('fast_path_helpers', '?')}) and "
                     "µs per call inside a replayed CUDA graph (20 calls per graph, L2 warm):")
        lines.append("")
        head2 = ["#", "tokens"] + [h for n in report.impls for h in (f"{n} host",
                                                                     f"{n} × add_")] + [
            f"{n} graph" for n in report.impls]
        lines.append("| " + " | ".join(head2) + " |")
        lines.append("|" + "---|" * len(head2))
        for w in report.workloads:
            row = [str(w.index), str(w.tokens)]
            row += [c for n in report.impls for c in (_f(w.impls[n].host_us, "{:.1f}"),
                                                       _f(w.impls[n].host_add_ratio))]
            row += [_f(w.impls[n].graph_us) for n in report.impls]
            lines.append("| " + " | ".join(row) + " |")
    else:
        plan = report.settings.get("plan", "full sizes")
        lines.append("No CUDA device: checked the real Triton kernel through Triton's interpreter "
                     "against qkrope.reference (≥ 99% of the elements of each output within "
                     "atol + 5%, none NaN/Inf"
                     + ("; cache length C+S" if layout == "bhsd" else "") + f"), at {plan}. "
                     "Timing needs a CUDA GPU.")
        lines.append("")
        if main not in report.impls:
            lines.append("Nothing checked: without a CUDA GPU only qkrope's kernel is checked, "
                         "and qkrope is not in --impl.")
        else:
            cg = report.checked_geometry
            lines.append("| # | S | C | B | checked at | atol | worst match | max abs err "
                         "| correct |")
            lines.append("|---|---|---|---|---|---|---|---|---|")
            for w in report.workloads:
                m = w.impls.get(main) or ImplResult()
                at = []
                if w.checked_seq_len not in (None, w.seq_len):
                    at.append(f"S={w.checked_seq_len}")
                if w.checked_batch not in (None, w.batch):
                    at.append(f"B={w.checked_batch}")
                if cg:
                    at.append(f"{cg['num_q_heads']}/{cg['num_kv_heads']} heads")
                lines.append(f"| {w.index} | {w.seq_len} | {w.cache_len} | {w.batch} | "
                             f"{', '.join(at) or 'full size'} | {w.atol:g} | "
                             f"{_f(m.match_fraction, '{:.4%}')} | "
                             f"{_f(m.max_abs_err, '{:.3g}')} | {_status(m)} |")
    errors = [(w.index, n, r.error) for w in report.workloads for n, r in w.impls.items()
              if r.error]
    if errors:
        lines.append("")
        lines += [f"- error in #{i} {n}: {e}" for i, n, e in errors]
    if report.skipped:
        lines.append("")
        lines += [f"- skipped {n}: {why}" for n, why in report.skipped.items()]
    return "\n".join(lines) + "\n"


def write_json(report: BenchReport, path: str | os.PathLike) -> None:
    """Every number and the environment; replaced atomically, so a run stopped at any moment
    leaves the last complete write (partial results have ``"complete": false``)."""
    data = asdict(report)
    data["geomean_us"] = {n: report.geomean(n) for n in report.impls}
    data["floor_geomean_us"] = report.floor_geomean()
    data["copy_geomean_us"] = report.copy_geomean()
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:  # leave no stray .tmp beside the path
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise


def write_plot(report: BenchReport, path: str) -> None:
    """Latency vs tokens on log axes for each implementation, with the bandwidth floor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'qkrope[plot]'") from e
    if not report.timed:
        raise RuntimeError("--plot needs timings, and timing needs a CUDA GPU")
    ws = sorted(report.workloads, key=lambda w: (w.tokens, w.batch))
    # Decode batches (S = 1, B > 1) and the rest are separate series: at equal token counts they
    # are different problems, and one line through both would zig-zag.
    series = [("", [w for w in ws if not (w.seq_len == 1 and w.batch > 1)], "-"),
              (" (decode batches)", [w for w in ws if w.seq_len == 1 and w.batch > 1], ":")]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, n in enumerate(report.impls):
        color = f"C{i}"
        for suffix, group, style in series:
            pts = [(w.tokens, w.impls[n].median_us) for w in group if w.impls[n].median_us]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", ms=4, color=color, label=n + suffix)
    ax.plot([w.tokens for w in ws], [w.floor_us for w in ws], "k--", lw=1,
            label=f"floor (bytes / {report.copy_bandwidth / 1e12:.2f} TB/s copy)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (B·S)")
    ax.set_ylabel("GPU µs per call (median, L2 flushed)")
    env = report.environment
    ax.set_title(f"QK-norm + RoPE + KV-cache write, {report.model}\n{env.get('gpu')}, torch "
                 f"{env['torch']}, triton {env['triton']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
