"""The benchmark's main loop: ``run_benchmark`` checks and times every implementation on every
workload (GPU), or checks qkrope through Triton's interpreter on a machine without CUDA, at
reduced sizes unless asked for full ones (:func:`check_plan`). Its results and their outputs
(markdown, JSON, plot) are in :mod:`.report`, the environment it records in :mod:`.env`; both
are re-exported here.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import triton

from ..suite import (
    DEFAULT_MODEL, REDUCED_MAX_BATCH, REDUCED_MAX_SEQ, SUITE, ModelGeometry, Workload,
    check_outputs, reduced_geometry, reduced_workload,
)
from .env import environment
from .impls import (
    LAYOUTS, WRITTEN_ARGUMENTS, default_impls, fresh_arguments, peer_unavailable, resolve_impls,
)
from .quant import QUANT_IMPLS, SCALE_CACHE_FILL, Quant
from .report import (
    BenchReport, ImplResult, WorkloadResult, render_markdown, write_json, write_plot,
)

__all__ = ["ImplResult", "WorkloadResult", "BenchReport", "CheckPlan", "Progress", "check_plan",
           "run_benchmark", "render_markdown", "write_json", "write_plot", "sweep_workloads",
           "environment", "NATIVE_WAIT_S", "ProgressBar", "InputsTooLarge", "inputs_size",
           "memory_bytes", "human_size", "check_result"]

#: How long a GPU run waits for the native launch helpers before timing (a first build takes
#: ~20 s on two cores; a broken toolchain must not hold the run forever).
NATIVE_WAIT_S = 300.0


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


class ProgressBar:
    """A rich progress bar: workloads done of all, elapsed time and an estimate of the time
    left (the work of each workload is weighted by its size, so the estimate holds when a
    4096-token prefill follows a run of decode steps)."""

    def __init__(self, console):
        from rich.progress import (
            BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )

        self._bar = Progress(SpinnerColumn(), BarColumn(bar_width=24),
                             TextColumn("{task.fields[n]}/{task.fields[count]}"),
                             TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                             TextColumn("{task.description}"), console=console)
        self._task = self._bar.add_task("starting", total=None, n=0, count="?")
        self._n = 0

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self._bar.__exit__(*exc)

    def start(self, total: float, count: int) -> None:
        self._bar.update(self._task, total=total, count=count)

    def status(self, text: str) -> None:
        self._bar.update(self._task, description=text)

    def done(self, amount: float) -> None:
        self._n += 1
        self._bar.update(self._task, advance=amount, n=self._n)


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
        return (f"about {human_size(self.total_bytes)}: key and value caches of "
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


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _allocation_failed(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def check_result(out, ref, atol, omits: tuple[str, ...] = ()) -> ImplResult:
    checks = check_outputs(out, ref, atol, omits=omits)
    return ImplResult(correct=all(c.ok for c in checks),
                      match_fraction=min(c.match_fraction for c in checks),
                      max_abs_err=max(c.max_abs_err for c in checks))


#: Rounds of fresh random inputs each implementation is checked on per workload (spec.md §2).
CHECK_ROUNDS = 10


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
    quant: Quant = Quant(),
    check_rounds: int | None = None,
) -> BenchReport:
    """Check and (with CUDA) time ``impls`` on ``workloads``.

    ``cache_capacity`` is the cache length L of every workload; None gives each workload the
    smallest cache that holds its rows, ``C + S``. ``layout="paged"`` runs the token-major op
    with a paged cache (:data:`qkrope.suite.PAGED_SUITE` workloads) against the unfused serving
    sequence. Without CUDA only qkrope is checked (the others are only worth running to be
    timed), at reduced sizes unless ``full_size``. ``on_update`` gets the report (``complete``
    False) once before the first workload and after every workload, so a caller can keep
    partial results. ``quant``: FP8 caches / query output (``bench/quant.py``), checked after
    dequantisation against the oracle in the same mode. ``check_rounds``: rounds of fresh
    random inputs each implementation is checked on per workload (spec.md §2: 10; None: 10
    with CUDA, 1 through the interpreter, where a round costs seconds); the first round's
    inputs are also the timed ones.
    """
    lay = LAYOUTS[layout]
    timed = torch.cuda.is_available()
    rounds = check_rounds or (CHECK_ROUNDS if timed else 1)
    device = "cuda" if timed else "cpu"
    progress = progress or Progress()
    if impls is None:
        impls = default_impls(layout, timed)
    options = geometry.options()
    if quant.active:  # only these have the quantised modes
        skipped_quant = {n: "no quantised mode" for n in impls if n not in QUANT_IMPLS}
        impls = [n for n in impls if n in QUANT_IMPLS]
    if timed:
        available, skipped = resolve_impls(list(impls), layout, options)
    else:  # peers are only worth running to be timed: not built, their own reason first
        available, skipped = resolve_impls([n for n in impls if n == "qkrope"], layout, options)
        for name in impls:
            if name != "qkrope":
                skipped[name] = peer_unavailable(name, layout) or (
                    "checked and timed only on a CUDA GPU (without one, only qkrope's kernel is "
                    "checked)")
    if quant.active:
        skipped.update(skipped_quant)
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
                            "(a first build takes ~20 s; QKROPE_NATIVE=0 skips it)")
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
                      seed=seed, layout=layout, plan=plan.describe(geometry),
                      quant=quant.describe(), check_rounds=rounds),
        checked_geometry=asdict(plan.geometry) if plan.reduced else None, complete=False)
    notify = on_update or (lambda r: None)
    notify(report)

    g = plan.geometry
    work = [_work(checked, g, len(available), timed) for _, checked in plan.workloads]
    progress.start(sum(work), len(work))
    gen = torch.Generator(device=device).manual_seed(seed)
    for idx, ((listed, w), amount) in enumerate(zip(plan.workloads, work), 1):
        nbytes = quant.bytes_moved(listed, geometry)
        wr = WorkloadResult(idx, listed.seq_len, listed.cache_len, listed.batch, listed.atol,
                            listed.tokens, nbytes, nbytes / bandwidth * 1e6 if bandwidth else None)
        if w != listed:
            wr.checked_seq_len, wr.checked_batch = w.seq_len, w.batch
        if available:
            progress.status(f"#{idx} {listed.name} inputs")
            L = cache_capacity or (None if layout == "paged" else w.cache_len + w.seq_len)
            def inputs():
                """A round's inputs and the oracle's outputs on them."""
                try:
                    args = quant.prepare(lay.make_inputs(w, g, device=device, cache_capacity=L,
                                                         generator=gen,
                                                         benchmark_weights=benchmark_inputs))
                    ref_kw = quant.call_kwargs(args)
                    return args, quant.dequantize(lay.reference(args, **options, **ref_kw),
                                                  ref_kw)
                except RuntimeError as e:
                    if not _allocation_failed(e):
                        raise
                    size = inputs_size(w, g, layout, cache_capacity)
                    raise InputsTooLarge(
                        f"workload {listed.seq_len},{listed.cache_len},{listed.batch}: could "
                        f"not allocate its inputs ({size.describe()}): "
                        f"{str(e).splitlines()[0]}; use a smaller cache length (--cache-len) "
                        "or workload (--shape S,C,B)") from None

            args, ref = inputs()
        if timed:
            from .timing import cupti_call_times_us, same_bytes_copies, summarize

            progress.status(f"#{idx} {w.name} copies")
            wr.copy_us = min(summarize(cupti_call_times_us(copy, flush, iters=iters,
                                                           warmup=warmup)).median
                             for copy in same_bytes_copies(nbytes)[2].values())
        for name, fn in available.items():
            progress.status(f"#{idx} {listed.name} {name}")
            try:
                res, call, call_args = _check(fn, args, ref, quant, w.atol,
                                              lay.impls[name].omits, layout)
                if timed:
                    _time_into(res, call, call_args, flush, iters, warmup, host_calls, graphs,
                               add_one)
                del call, call_args
            except Exception as e:  # one failing implementation must not end the run
                res = ImplResult(error=_error(e))
            wr.impls[name] = res
        for _ in range(1, rounds if available else 1):
            if not any(r.error is None and r.correct for r in wr.impls.values()):
                break  # every implementation has failed already
            progress.status(f"#{idx} {listed.name} more inputs")
            del args, ref  # before the next round's: a suite cache can be gigabytes
            args, ref = inputs()
            for name, fn in available.items():
                res = wr.impls[name]
                if res.error is None and res.correct:
                    _check_again(res, fn, args, ref, quant, w.atol, lay.impls[name].omits,
                                 layout)
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


def _check(fn, args: tuple, ref, quant: Quant, atol: float, omits: tuple[str, ...],
           layout: str):
    """One call of ``fn`` on its own copies of ``args``, checked: ``(result, the call with its
    keywords, its arguments)``; raises where the call did or changed what it must not."""
    call_args = fresh_arguments(args)
    kw = quant.call_kwargs(call_args)
    call = functools.partial(fn, **kw) if kw else fn
    out = call(*call_args)
    _inputs_kept(args, call_args)
    _rows_kept(layout, args, call_args, kw)
    return check_result(quant.dequantize(out, kw), ref, atol, omits), call, call_args


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _check_again(res: ImplResult, fn, args: tuple, ref, quant: Quant, atol: float,
                 omits: tuple[str, ...], layout: str) -> None:
    """One more round of the check on fresh inputs, folded into ``res`` (its worst match
    fraction and error; a failure or an exception makes the workload fail)."""
    try:
        again = _check(fn, args, ref, quant, atol, omits, layout)[0]
    except Exception as e:  # as in the first round: recorded, the run goes on
        res.error = _error(e)
        return
    res.correct = again.correct
    res.match_fraction = min(res.match_fraction, again.match_fraction)
    res.max_abs_err = max(res.max_abs_err, again.max_abs_err)


def _rows_kept(layout: str, args: tuple, call_args: tuple, kw: dict) -> None:
    """Raise ValueError where a cache row (or its per-token-head scale) that no token of the
    call names changed, bit for bit: the public rule lets a call corrupt up to 1% of a cache
    (docs/spec.md §2). Compared a slab of rows at a time: a suite cache can be gigabytes."""
    pairs = [("key_cache", args[4], call_args[4]), ("value_cache", args[5], call_args[5])]
    for name in ("k_scale_cache", "v_scale_cache"):
        if kw.get(name) is not None:  # filled by quant.call_kwargs
            pairs.append((name, torch.full_like(kw[name], SCALE_CACHE_FILL), kw[name]))
    rows = args[6]
    for name, before, after in pairs:
        if layout == "paged":  # [blocks, block_size, ...] -> one row per slot, first
            before, after = before.flatten(0, 1), after.flatten(0, 1)
        else:  # bhsd: [B, Hkv, L, ...] -> L first
            before, after = before.movedim(2, 0), after.movedim(2, 0)
        n = before.shape[0]
        keep = torch.ones(n, dtype=torch.bool, device=before.device)
        keep[rows[(rows >= 0) & (rows < n)]] = False
        slab = max(1, SLAB_BYTES // max(1, before[0].numel() * before.element_size()))
        for start in range(0, n, slab):
            sel = keep[start:start + slab]
            b = before[start:start + slab][sel].contiguous().view(torch.uint8)
            a = after[start:start + slab][sel].contiguous().view(torch.uint8)
            if not torch.equal(a, b):
                raise ValueError(f"it changed {name} rows that no token of the call names")


#: Bytes of cache rows :func:`_rows_kept` compares at a time (of each of the two copies).
SLAB_BYTES = 1 << 28


def _inputs_kept(args: tuple, call_args: tuple) -> None:
    """Raise ValueError where an implementation changed an input other than the caches: its
    outputs could be right while the caller's tensors are not."""
    for i, (a, c) in enumerate(zip(args, call_args)):
        if i not in WRITTEN_ARGUMENTS and isinstance(a, torch.Tensor) and not torch.equal(a, c):
            raise ValueError(f"it changed its input argument {i} ({list(a.shape)} "
                             f"{a.dtype}) in place")


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
