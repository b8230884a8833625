"""The timing protocol: GPU time of a call's kernels from CUPTI activity records, L2 flushed
before every call, warm-ups, then order statistics; plus host time per eager call, CUDA-graph
replay time and the device-to-device copy bandwidth that the floor is measured against.

The pure functions (grouping of kernel records into calls, statistics) take plain data so they
are tested on machines without a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "KernelRecord", "Stats", "summarize", "split_calls", "L2Flusher", "cupti_call_times_us",
    "host_time_per_call_us", "graph_replay_time_us", "copy_bandwidth", "same_bytes_copies",
]

FLUSH_KERNEL_NAME = "qkrope_l2_flush_kernel"


@dataclass(frozen=True)
class KernelRecord:
    """One GPU activity (kernel, memcpy or memset): name and [start, end) in ns."""

    name: str
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Stats:
    """Order statistics of per-call times in µs."""

    median: float
    p20: float
    p80: float
    n: int

    def as_dict(self) -> dict:
        return {"median_us": self.median, "p20_us": self.p20, "p80_us": self.p80, "n": self.n}


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted sequence (numpy's default method)."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times_us: Sequence[float]) -> Stats:
    if not times_us:
        raise ValueError("no timings to summarize")
    xs = sorted(times_us)
    return Stats(statistics.median(xs), _quantile(xs, 0.2), _quantile(xs, 0.8), len(xs))


def split_calls(records: Sequence[KernelRecord], marker: str = FLUSH_KERNEL_NAME) -> list[float]:
    """Per-call GPU time in µs: records are cut into calls at each ``marker`` kernel (the L2
    flush launched before every call); a call spans its first record's start to its last
    record's end, so gaps between several kernels of one call count."""
    calls: list[list[KernelRecord]] = []
    current: list[KernelRecord] | None = None
    for rec in sorted(records, key=lambda r: r.start_ns):
        if marker in rec.name:
            current = []
            calls.append(current)
        elif current is not None:
            current.append(rec)
    times = []
    for i, call in enumerate(calls):
        if not call:
            raise RuntimeError(f"call {i} launched no GPU work between two L2 flushes")
        times.append((max(r.end_ns for r in call) - min(r.start_ns for r in call)) / 1e3)
    return times


@triton.jit
def qkrope_l2_flush_kernel(buf_ptr, n, value, BLOCK: tl.constexpr):
    # A uniquely named kernel so the timing code can find call boundaries in CUPTI records.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(buf_ptr + offs, tl.full((BLOCK,), value, tl.int32), mask=offs < n)


class L2Flusher:
    """Writes a buffer of twice the device's L2 size, evicting whatever the last call left."""

    BLOCK = 4096

    def __init__(self, device: torch.device | str = "cuda"):
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
        self.buf = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
        self._i = 0

    def __call__(self) -> None:
        self._i += 1
        n = self.buf.numel()
        qkrope_l2_flush_kernel[(triton.cdiv(n, self.BLOCK),)](self.buf, n, self._i,
                                                                BLOCK=self.BLOCK)


def _gpu_records(prof) -> list[KernelRecord]:
    recs = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        recs.append(KernelRecord(e.name(), e.start_ns(), e.start_ns() + e.duration_ns()))
    return recs


def cupti_call_times_us(fn: Callable[[], object], flush: L2Flusher, *, iters: int = 50,
                        warmup: int = 10) -> list[float]:
    """GPU time of each of ``iters`` calls of ``fn`` (µs), each preceded by an L2 flush."""
    for _ in range(warmup):
        flush()
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            flush()
            fn()
        torch.cuda.synchronize()
    times = split_calls(_gpu_records(prof))
    if len(times) != iters:
        raise RuntimeError(f"expected {iters} timed calls in the CUPTI trace, found {len(times)}")
    return times


def _run_us(fn: Callable[[], object], n: int) -> float:
    """µs per call of ``n`` back-to-back calls, synchronised at the end."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def host_time_per_call_us(fn: Callable[[], object], calls: int = 2000,
                          batches: int = 5) -> float:
    """Wall-clock µs per call of back-to-back eager calls (what an eager caller waits for when
    the GPU keeps up: Python, checks, allocation and launch): ``calls`` calls in ``batches``
    equal runs, the median run's µs per call (one run disturbed by another process on the
    host does not move the figure)."""
    for _ in range(min(calls, 20)):
        fn()
    torch.cuda.synchronize()
    per_batch = max(calls // batches, 1)
    return statistics.median(_run_us(fn, per_batch) for _ in range(batches))


def host_times_beside_us(fn: Callable[[], object], reference: Callable[[], object],
                         calls: int = 2000, batches: int = 10) -> tuple[float, float, float]:
    """``(fn µs, reference µs, fn / reference)`` per call: ``calls`` calls of each in
    ``batches`` runs, alternating reference and fn, so both see the same host state (a shared
    host's speed drifts by 1.5x within seconds); the median run of each and the median of the
    ratios of each run of ``fn`` to the run of ``reference`` just before it."""
    for _ in range(min(calls, 20)):
        reference()
        fn()
    torch.cuda.synchronize()
    per_batch = max(calls // batches, 1)
    ref_us, fn_us = [], []
    for _ in range(batches):
        ref_us.append(_run_us(reference, per_batch))
        fn_us.append(_run_us(fn, per_batch))
    ratio = statistics.median(f / r for f, r in zip(fn_us, ref_us))
    return statistics.median(fn_us), statistics.median(ref_us), ratio


def graph_replay_time_us(fn: Callable[[], object], calls_per_graph: int = 20,
                         replays: int = 20) -> float:
    """µs per call when ``calls_per_graph`` calls are captured in one CUDA graph and replayed
    (L2 warm; the per-op cost inside a captured decode step). Raises if ``fn`` can't be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    per_call = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    del graph
    return statistics.median(per_call)


def copy_bandwidth(nbytes: int = 2**31, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (median over ``iters`` copies of an ``nbytes`` buffer, far larger than L2)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@triton.jit
def qkrope_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """A plain streaming copy: the yardstick for moving a given number of bytes."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


COPY_BLOCK = 2048  # bf16 elements per program: 4 KB, the best of 512-4096 measured on the H200


def same_bytes_copies(nbytes: int, device: torch.device | str = "cuda"
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Callable[[], object]]]:
    """``(src, dst, calls)``: calls that copy bf16 ``src`` into ``dst``, moving ``nbytes``
    through DRAM (half read, half written, rounded up to whole blocks), with torch's copy kernel
    and with a Triton streaming copy (which is faster depends on the size). Timed like the op,
    the faster one shows how much of the gap to the bandwidth floor is launch and latency cost
    that any kernel moving those bytes pays."""
    # A whole number of Triton blocks: a ragged tail would cost the copy its vector loads.
    n = triton.cdiv(max(nbytes // 4, 1), COPY_BLOCK) * COPY_BLOCK
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    grid = (n // COPY_BLOCK,)
    return src, dst, {
        "torch copy_": lambda: dst.copy_(src),
        "triton copy": lambda: qkrope_copy_kernel[grid](src, dst, n, BLOCK=COPY_BLOCK,
                                                        num_warps=4),
    }


_TRIVIAL = []


def _trivial_op() -> Callable:
    """A registered op that only adds one to a tensor, defined the way qkrope's ops are: the
    floor of a registered op's host time inside a compiled graph."""
    if not _TRIVIAL:
        from ..ops._custom_op import custom_op

        def host_floor(x: torch.Tensor) -> None:
            x.add_(1)

        _TRIVIAL.append(custom_op("host_floor", host_floor, mutates_args=("x",)))
    return _TRIVIAL[0]


def op_host_times(calls: int = 1000, rounds: int = 5) -> dict:
    """Host µs per call (the best of 5 batches of ``calls / 5`` back-to-back calls) of the op
    through its eager fast path, and of one call of the op inside a compiled graph beside one
    of a trivial registered op (``_trivial_op``) there: a graph's own entry cost is shared by
    every op in it, so an op's cost there is the slope between a graph of 1 and of 5 calls,
    the median of ``rounds`` rounds that time the four graphs in turn (a slope is a difference
    of two timings: one round's can be off by half). Decode #1 shapes, outputs given;
    ``x.add_(1)`` eager for scale."""
    from .. import run
    from ..suite import SUITE, make_inputs

    a = make_inputs(SUITE[0], device="cuda", cache_capacity=64)
    q_out, k_out = torch.empty_like(a[0]), torch.empty_like(a[1])
    x = torch.zeros(1, device="cuda")
    trivial = _trivial_op()

    def op():
        run(*a, query_out=q_out, key_out=k_out)

    def repeated(fn, k):
        def body():
            for _ in range(k):
                fn()
        return torch.compile(body, fullgraph=True)

    def per_call(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            best = min(best, (time.perf_counter() - t0) / (calls // 5))
            torch.cuda.synchronize()
        return best * 1e6

    with torch.no_grad():
        out = {"eager fast path": per_call(op), "x.add_(1) eager": per_call(lambda: x.add_(1))}
        graphs = {(name, k): repeated(fn, k)
                  for name, fn in (("compiled graph", op),
                                   ("trivial op, compiled graph", lambda: trivial(x)))
                  for k in (1, 5)}
        times = {g: [] for g in graphs}
        for _ in range(rounds):  # in turn: a drift of the host's speed hits all four alike
            for g, fn in graphs.items():
                times[g].append(per_call(fn))
        for name in ("compiled graph", "trivial op, compiled graph"):
            one, five = times[(name, 1)], times[(name, 5)]
            out[f"{name}, 1 call"] = statistics.median(one)
            out[f"{name}, per call"] = statistics.median((f - o) / 4 for o, f in zip(one, five))
    torch._dynamo.reset()
    return out
