"""``qkrope bench --e2e``: what users run, a Qwen3-family model, stock vs patched.

A model of a few decoder layers (``layers``, default 4) at the real width of a preset, random
weights (no download), bf16, a ``StaticCache``; per batch, a decode step (one new token per
sequence after a prompt) and a prefill of ``prefill_len`` tokens, in four modes: eager,
``torch.compile`` (default mode), ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), and
``model.generate(..., cache_implementation="static")``, which compiles the decode step itself.
Each figure is wall time per step with the device synchronised, so host time counts; beside
it the step's host part (until the forward returned), so a difference splits into host work
and time waited for the GPU.

Stock and patched each run in worker processes of their own, as in a user's process: nothing
of the other variant there (compiled code, CUDA-graph trees, the allocator's pool; docs/
design.md, "End-to-end bench"); two per variant on a GPU (:data:`PROCESSES`), their times
pooled, as one process's host runs at a speed of its own. The parent sets all up side by side
(compiles, untimed), then times them in alternating blocks of steps (:data:`BLOCK`), one
process on the GPU at a time and all on one core, so a drift of the machine's speed hits both
variants alike; which variant goes first alternates from pair to pair of blocks. A variant's
figure is the median over its blocks of each block's median step time (:func:`block_median`);
beside each speed-up (the ratio of those), a 95% interval from resampling the processes and
the pairs of blocks (:func:`speedup_interval`): a cell whose interval holds 1.0 is a tie
within this run's noise.

Correctness: random weights give near-ties, so greedy tokens alone prove nothing. Both
variants are fed the same fixed token stream (teacher forcing) and their last logits are
compared with the stock eager model's: the patched model may deviate no more than the stock
model compiled the same way does (twice that plus one bf16 ulp), and in eager mode no more
than ``EAGER_ULPS`` ulps (the kernel's last-ulp trig/rsqrt differences can flip a rare bf16
rounding). For ``generate`` the first compiled step's logits are compared the same way.

Also the op's host time inside a compiled graph beside its eager fast path's and a trivial
op's, measured in the same process (``timing.op_host_times``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
import types
from collections.abc import Callable, Sequence

import torch

__all__ = ["PRESETS", "MODES", "PHASES", "E2EReport", "run_e2e", "render_e2e_markdown",
           "block_median", "speedup_interval", "write_e2e_json", "read_e2e_json",
           "write_e2e_plot", "run_command"]

VOCAB = 32000  # every preset: the lm_head is a constant of both models, kept small
TINY_VOCAB = 256  # the CPU path's tiny model
#: Attention and MLP widths of the presets (their linear-attention layers are left out: the
#: patch does not touch them).
PRESETS = {
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, intermediate_size=12288,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    "qwen3-32b": ("qwen3", dict(hidden_size=5120, intermediate_size=25600,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128)),
    "qwen3.5-27b": ("qwen3.5", dict(hidden_size=5120, intermediate_size=17408,
                                    num_attention_heads=24, num_key_value_heads=4,
                                    head_dim=256)),
}
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)
MODES = ("eager", "compile", "reduce-overhead", "generate")
PHASES = ("decode", "prefill")
PROMPT = 32          # tokens before the timed decode steps
GENERATE_TOKENS = (8, 72)  # generate() lengths whose time difference gives the per-token time
#: Timed decode steps per cell and variant (prefills: :func:`prefill_steps`): a cell's speed-up
#: is a median ratio of ~1.00-1.03 in the CUDA-graph modes, where 6 pairs of blocks left a 95%
#: interval of about ±2-3% on a noisy host; decode steps cost 1-9 ms, the compiles dominate a
#: cell's time (150 steps add under a second per cell to 60's).
STEPS = 150
#: Timed steps run in blocks of this many per variant (prefills: PREFILL_BLOCK), the variants'
#: processes alternating: a drift of the machine's speed still hits both alike, and 9 decode
#: steps in 10 follow a step of their own process (the first of a block may find caches and
#: clocks as the other process left them; every step's time is kept in the JSON, so that
#: shows). A prefill (2-100 ms) is long beside a switch, and the GPU's speed drifts within a
#: cell: prefill blocks are short (docs/design.md, "End-to-end bench").
BLOCK = 10
PREFILL_BLOCK = 2
#: Timed prefills per cell and variant on a GPU: :func:`prefill_steps`, then more blocks while
#: the variant's timed prefills total under PREFILL_BUDGET_MS, up to PREFILL_MOST. A batch-1
#: prefill (2-5 ms) costs what a decode step does, and on 20 its compiled cells, GPU ties
#: within 1-2%, read 0.98-1.03x from run to run (docs/design.md, "End-to-end bench"); a
#: batch-64 prefill (90-250 ms) stays at 20.
PREFILL_BUDGET_MS = 1000.0
PREFILL_MOST = 100
#: Worker processes per variant on a GPU: one process's host runs at a speed of its own for
#: its life (processes of one variant on one core: 3-7% apart in the host part of a CUDA-graph
#: step, 0.6-1.6% in its wall time), as large as what separates the variants in the CUDA-graph
#: cells; two per variant halve its weight and the interval shows it (docs/design.md,
#: "End-to-end bench")
PROCESSES = 2
#: generate() rounds per variant, each giving one per-token time (median): a round's figure is
#: a difference of two runs, which moved by 0.7-2x between rounds on a noisy host
GENERATE_ROUNDS = 15


@dataclasses.dataclass
class Cell:
    preset: str
    batch: int
    phase: str
    mode: str
    stock_ms: float | None = None    # ms a step, block_median of the timed steps
    patched_ms: float | None = None
    # ms of a step's host part (block_median): from the call until the forward returned,
    # before the synchronisation (guards, Python, launches or a CUDA-graph replay's launch);
    # the rest of a step is GPU time the host waited for (None for generate(): one call)
    stock_host_ms: float | None = None
    patched_host_ms: float | None = None
    # 95% interval of the speed-up: the ratio of block medians over resampled pairs of blocks
    speedup_interval: tuple[float, float] | None = None
    stock_dev: float | None = None     # max |logit - stock eager logit| of the stock model
    patched_dev: float | None = None   # ... of the patched model
    allowed_dev: float | None = None   # what the patched model may deviate
    graphs: int | None = None          # graphs compiled, stock + patched (None: eager)
    graph_breaks: int | None = None
    recompiles_after_warmup: int | None = None
    error: str | None = None
    # every timed step's ms in run order (JSON only): blocks of BLOCK per variant, or one per
    # generate() round; where the first step of a block pays for the switch, it shows here
    stock_times: list[float] | None = None
    patched_times: list[float] | None = None
    stock_host_times: list[float] | None = None  # each timed step's host part, the same order
    patched_host_times: list[float] | None = None
    block: int | None = None  # the times' run length per variant (BLOCK, PREFILL_BLOCK or 1)

    @property
    def speedup(self) -> float | None:
        if self.stock_ms and self.patched_ms:
            return self.stock_ms / self.patched_ms
        return None

    @property
    def correct(self) -> bool | None:
        if self.patched_dev is None or self.allowed_dev is None:
            return None
        return self.patched_dev <= self.allowed_dev


@dataclasses.dataclass
class E2EReport:
    environment: dict
    layers: int
    timed: bool
    cells: list[Cell] = dataclasses.field(default_factory=list)
    op_host_us: dict = dataclasses.field(default_factory=dict)
    processes: int = 1  # worker processes per variant


def build_model(preset: str, layers: int, device: str, seed: int = 0, tiny: bool = False):
    """A random ``layers``-layer model of ``preset``'s family and width (bf16, eval)."""
    import transformers

    family, width = PRESETS[preset]
    cfg = dict(width if not tiny else TINY, vocab_size=VOCAB if not tiny else TINY_VOCAB,
               num_hidden_layers=layers, max_position_embeddings=40960, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    else:
        half = (cfg["head_dim"] // 4) // 2   # partial_rotary_factor 0.25: rotary frequencies
        section = [half - 2 * (half // 3), half // 3, half // 3]
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7,
                                  "partial_rotary_factor": 0.25, "mrope_section": section,
                                  "mrope_interleaved": True}
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            **cfg, layer_types=["full_attention"] * layers))
    model = model.to(device, torch.bfloat16).eval()
    with torch.no_grad():  # random q/k norm weights: all ones would hide a kernel ignoring them
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_((0.0 if family == "qwen3.5" else 1.0) + 0.5 * torch.randn_like(p))
    return model


def cache_keyword(model) -> str:
    """Where the installed transformers' model takes its cache: ``cache`` from 5.24, before
    that ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(type(model).forward).parameters \
        else "past_key_values"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return (int(counters["stats"]["unique_graphs"]),
            int(sum(counters["graph_break"].values())))


def prefill_steps(steps: int) -> int:
    """The fewest timed prefills per cell and variant for ``steps`` decode steps: a third,
    from 4 to 20 (a prefill costs 2-250 ms; 20 in blocks of :data:`PREFILL_BLOCK` gave ±1-2%
    at batch 8 and 64; cheaper ones run more: :data:`PREFILL_BUDGET_MS`)."""
    return max(4, min(20, steps // 3))


def _forward(model, mode: str, device: str) -> Callable:
    """``model.forward`` for ``mode``: compiled, on a code object of its own. Dynamo keeps a
    frame's compiled entries per code object: where two variants run in one process
    (``benchmarks/e2e_profile.py``), compiled from the one method they would share a list, and
    every step would first run the other variant's guards and fail, host time no user's process
    spends (docs/design.md, "End-to-end bench")."""
    if mode == "eager":
        return model.forward
    fn = model.forward.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    # Off a GPU only the tracing can be checked: compile with dynamo's own (eager) backend.
    backend = "inductor" if device == "cuda" else "eager"
    return torch.compile(types.MethodType(own, model), backend=backend,
                         mode="reduce-overhead" if mode == "reduce-overhead" and
                         device == "cuda" else None)


def step_guards(compiled, *args, **kwargs):
    """The guards a compiled forward checks before every call with these arguments, as
    ``(manager, frame)``: ``manager.check(frame)`` evaluates them alone (host time of every
    compiled step, CUDA-graph replays included: docs/perf-notes.md, lead 5 h). ``compiled``:
    ``torch.compile`` of a bound forward (:func:`_forward`, ``model.forward``); call under the
    grad mode of the steps (a guard). None where no compiled entry takes these arguments."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    method = compiled._torchdynamo_orig_callable
    fn = method.__func__  # transformers' wrappers: the frame Dynamo compiled
    # (its parameters differ between transformers versions: bound by its signature)
    bound = inspect.signature(fn, follow_wrapped=False).bind(method.__self__, *args, **kwargs)
    bound.apply_defaults()
    frame = {**bound.arguments, **{name: cell.cell_contents for name, cell in
                                   zip(fn.__code__.co_freevars, fn.__closure__ or ())}}
    for entry in _debug_get_cache_entry_list(fn.__code__):
        if entry.guard_manager.check(frame):
            return entry.guard_manager, frame
    return None


class _Stepper:
    """One variant's state for a cell: its own StaticCache, filled by an eager prefill of the
    prompt (decode) or allocated by one eager prefill (prefill), and :meth:`step`, one timed
    forward on the fixed token ``stream`` (wall ms, synchronised: host time counts)."""

    def __init__(self, model, forward, stream, phase: str, device: str, cudagraphs: bool):
        from transformers import StaticCache

        self.forward, self.stream, self.phase = forward, stream, phase
        self.device, self.cudagraphs = device, cudagraphs
        rows = stream.shape[1] + 1
        self.cache = StaticCache(config=model.config, max_cache_len=rows)
        self.kw = {cache_keyword(model): self.cache, "use_cache": True, "logits_to_keep": 1}
        with torch.no_grad():
            model(stream[:, :PROMPT] if phase == "decode" else stream, **self.kw)
        self.logits = None
        self.host_ms = None

    def step(self, i: int) -> float:
        B = self.stream.shape[0]
        with torch.no_grad():
            if self.phase == "decode":
                tok = self.stream[:, PROMPT + i:PROMPT + i + 1]
                kw = dict(self.kw, position_ids=None)
            else:
                self.cache.reset()
                tok, kw = self.stream, self.kw
            _sync(self.device)
            t0 = time.perf_counter()
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            if self.phase == "decode":
                kw["position_ids"] = torch.full((B, 1), PROMPT + i, device=tok.device)
            logits = self.forward(tok, **kw).logits
            # the host's part: the step's Python, guards, launches or a CUDA-graph replay's
            # launch, up to the forward's return (the GPU may still be running)
            self.host_ms = (time.perf_counter() - t0) * 1e3
            _sync(self.device)
            elapsed = time.perf_counter() - t0
            # Kept now: a CUDA-graph replay of the other variant reuses this output's memory.
            self.logits = logits[:, -1].float().clone()
        return elapsed * 1e3


def _generate(model, prompt, device: str, compiled: bool, n: int):
    """Seconds of one generate() of ``n`` new tokens, its first two steps' logits (prompt,
    first decode step) and its first token."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             cache_implementation="static", disable_compile=not compiled,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    _sync(device)
    return (time.perf_counter() - t0, [x.float().clone() for x in out.logits[:2]],
            out.sequences[:, prompt.shape[1]].clone())


def block_median(times: Sequence[float], block: int = 1) -> float:
    """A variant's figure for a cell: the median over its blocks (runs of ``block`` times in
    run order, as timed) of each block's median. The first step of a block pays for the
    switch from the other variant and runs slower in both (docs/design.md, "End-to-end
    bench"): in blocks of 2 prefills half the steps are such, and the median of the pooled
    steps fell between the two modes, set by the slowest settled and the fastest switching
    step alone; a block's median (of 2, their mean) takes both, a decode block's (of 10)
    leaves the switch out, as the pooled median did."""
    return statistics.median(_run_medians(times, block))


def _run_medians(times: Sequence[float], block: int) -> list[float]:
    """Each run's median: ``times`` cut into runs of ``block`` in run order."""
    return [statistics.median(times[i:i + block]) for i in range(0, len(times), block)]


def speedup_interval(stock: Sequence[float], patched: Sequence[float], block: int = 1,
                     resamples: int = 2000, level: float = 0.95,
                     processes: int = 1) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``block_median(stock) / block_median(patched)``. The
    i-th times of both variants ran close in time (in one pair of blocks, or one round of
    generate()), so pairs are resampled together: a drift of the machine's speed moves both.
    ``block``: the pairs were timed in runs of this many per variant, and are resampled by
    those runs: a burst of another tenant's host load slows a whole run of one variant, so its
    steps are not independent draws (docs/design.md, "End-to-end bench"). ``processes``: each
    variant ran in this many worker processes, run ``k`` in its ``k % processes``-th; a
    process's host runs at a speed of its own for its whole life, so the processes are
    resampled first (stock's ``r``-th with patched's ``r``-th), then the runs within each.
    None under 3 runs (per process)."""
    import random

    n = min(len(stock), len(patched))
    per_run = list(zip(_run_medians(stock[:n], block), _run_medians(patched[:n], block)))
    by_process = [per_run[r::processes] for r in range(processes)]
    if min(len(r) for r in by_process) < 3:
        return None
    rng = random.Random(0)  # the same data gives the same interval
    ratios = []
    for _ in range(resamples):
        picked = by_process if processes == 1 else \
            [by_process[rng.randrange(processes)] for _ in range(processes)]
        pairs = [own[rng.randrange(len(own))] for own in picked for _ in own]
        ratios.append(statistics.median(s for s, _ in pairs) /
                      statistics.median(p for _, p in pairs))
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1 - tail) * resamples))]


def _ulp(x: torch.Tensor) -> float:
    return float(2.0 ** (torch.floor(torch.log2(x.abs().max().clamp_min(1e-30))) - 7))


#: Eager bar, in bf16 ulps of the largest logit: the kernel matches torch's rounding points,
#: but its rsqrt/sin/cos may differ from torch's in the last fp32 ulp, which flips a rare bf16
#: rounding (README, "Numerics"; the op's tests bound every element by that); through a few
#: layers such a flip moves a logit by an ulp or two.
EAGER_ULPS = 4


class _Variant:
    """One variant's side of a worker process: its model (stock, or patched once and for
    all), and per cell its compiled forward and stepper. Each method is one request of the
    parent (:class:`_Worker`); what it returns crosses the pipe (floats, CPU tensors)."""

    def __init__(self, variant: str, preset: str, layers: int, device: str, seed: int):
        from ..integrations.transformers import patch

        self.device = device
        self.model = build_model(preset, layers, device, seed, tiny=device != "cuda")
        if variant == "patched":
            patch(self.model)
        self.stepper = self.stream = self.mode = None
        self.counts = (0, 0)

    def reference(self, stream, phase: str, generate: bool, steps: int):
        """The stock eager model's last logits on ``stream`` (``steps`` decode steps, or one
        prefill; for generate(), its first two steps' logits and its first token)."""
        stream = stream.to(self.device)
        if generate:
            _, logits, first = _generate(self.model, stream[:, :PROMPT], self.device, False, 2)
            return [x.cpu() for x in logits], first.cpu()
        ref = _Stepper(self.model, self.model.forward, stream, phase, self.device, False)
        for i in range(steps if phase == "decode" else 1):
            ref.step(i)
        return [ref.logits.cpu()], None

    def setup(self, mode: str, phase: str, stream, warmup: int) -> None:
        """Compile (and record) the cell's step and run its untimed warm-up."""
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        self.mode, self.stream = mode, stream.to(self.device)
        if mode == "generate":
            # Both lengths a round runs: each sizes its own static cache, and the first run of
            # a size compiles and records its graphs (a first round of 100-220 ms per token
            # where the others took 2-3: benchmarks/results/e2e-*-200b1c3.json, batch 1).
            for n in GENERATE_TOKENS if self.device == "cuda" else GENERATE_TOKENS[:1]:
                _generate(self.model, self.stream[:, :PROMPT], self.device,
                          self.device == "cuda", n)
        else:
            self.stepper = _Stepper(self.model, _forward(self.model, mode, self.device),
                                    self.stream, phase, self.device,
                                    mode == "reduce-overhead" and self.device == "cuda")
            for i in range(warmup):
                self.stepper.step(i)
        self.counts = _counters()

    def block(self, start: int, stop: int, core: int | None) -> list[tuple[float, float]]:
        """Timed steps ``start .. stop - 1``, on ``core`` (:func:`_pin`): ``(wall ms, host
        ms)`` each (:meth:`_Stepper.step`)."""
        _pin(core)
        return [(self.stepper.step(i), self.stepper.host_ms) for i in range(start, stop)]

    def generate_round(self, lo: int, hi: int, core: int | None) -> float:
        """ms per token of the tokens between a ``lo``- and a ``hi``-token generate() run
        back to back, on ``core``."""
        _pin(core)
        short, long = (_generate(self.model, self.stream[:, :PROMPT], self.device,
                                 self.device == "cuda", n)[0] for n in (lo, hi))
        return (long - short) / (hi - lo) * 1e3

    def finish(self):
        """``(logits, first token, graphs, breaks, recompiles after the warm-up)``; the cell's
        stepper and its cache are dropped."""
        if self.mode == "generate":
            _, logits, first = _generate(self.model, self.stream[:, :PROMPT], self.device,
                                         self.device == "cuda", 2)
            logits, first = [x.cpu() for x in logits], first.cpu()
        else:
            logits, first = [self.stepper.logits.cpu()], None
        _pin(None)  # the next cell's compile may use every core again
        graphs, breaks = self.counts
        self.stepper = self.stream = None  # the next setup resets the compiled code
        return (logits, first, graphs, breaks, _counters()[0] - graphs)


def _timing_core() -> int | None:
    """The one core all workers time on (the parent's last), or None where threads cannot be
    pinned. A thread's host speed depends on its core (its clock, a busy sibling thread, other
    tenants of the machine), and two processes' threads land on cores of their own: unpinned,
    a cell's stock and patched processes differed by up to 50% in host time for reasons
    neither variant has (docs/design.md, "End-to-end bench")."""
    try:
        return max(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


_ALL_CORES: set | None = None


def _pin(core: int | None) -> None:
    """Run this thread on ``core`` only; ``None``: on the cores it started with."""
    global _ALL_CORES
    if not hasattr(os, "sched_setaffinity"):
        return
    if _ALL_CORES is None:
        _ALL_CORES = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _ALL_CORES if core is None else {core})


def _serve(conn, variant: str, preset: str, layers: int, device: str, seed: int,
           native_wait: float) -> None:
    """A worker process's loop: ``(name, args)`` requests in, ``(ok, result or error line)``
    out, until ``stop`` or the parent's end of the pipe closes (the parent is gone: so is
    this process)."""
    from ..ops import _native

    if device == "cuda" and native_wait > 0 and _native.enabled():
        _native.load(timeout=native_wait)  # built by the parent: loaded from the cache
    try:
        state = _Variant(variant, preset, layers, device, seed)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
        conn.send((False, _error_line(e)))
        return
    # ready: the launch route this process's op takes, and a digest of the weights (both
    # processes built them from one seed: the parent checks that they match)
    with torch.no_grad():
        digest = [float(p.float().sum()) for p in state.model.parameters()]
    conn.send((True, (_native.status(), digest)))
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        if name == "stop":
            return
        try:
            reply = (True, getattr(state, name)(*args))
        except Exception as e:  # noqa: BLE001 - the cell's error, reported by the parent
            reply = (False, _error_line(e))
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


def _error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


class WorkerError(RuntimeError):
    """A worker's request failed (its error line), or the worker died or hung."""


#: Seconds a worker may take over one request (a cell's compile and warm-up is the longest)
#: before the parent gives up on it: a hung worker ends the run's cell, not the run.
REQUEST_TIMEOUT = 1800.0


class _Worker:
    """A process holding one variant of one preset's model (:func:`_serve`): stock and
    patched never share a process, as in a user's, so neither times the other's compiled
    code, CUDA-graph trees or allocator pool (docs/design.md, "End-to-end bench")."""

    def __init__(self, variant: str, preset: str, layers: int, device: str, seed: int,
                 native_wait: float, label: str | None = None):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state forked
        self.variant, self.preset = variant, preset
        self.label = label or variant  # in error lines: which of the variant's processes
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, daemon=True, name=f"qkrope-e2e-{self.label}",
                                args=(child, variant, preset, layers, device, seed,
                                      native_wait))
        self.proc.start()
        child.close()

    def send(self, name: str, *args) -> None:
        try:
            self.conn.send((name, args))
        except OSError:
            raise self._died() from None

    def _died(self) -> WorkerError:
        self.proc.join(1)
        return WorkerError(f"the {self.label} worker died (exit code {self.proc.exitcode})")

    def result(self, timeout: float = REQUEST_TIMEOUT):
        """The reply to the last request; raises WorkerError with the worker's error line,
        or when the worker died or overran ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise self._died()
            if time.monotonic() > deadline:
                raise WorkerError(f"the {self.label} worker gave no answer in {timeout:.0f} s")
        try:
            ok, value = self.conn.recv()
        except (EOFError, OSError):  # its end closed: it died
            raise self._died() from None
        if not ok:
            raise WorkerError(value)
        return value

    def call(self, name: str, *args):
        self.send(name, *args)
        return self.result()

    def close(self) -> None:
        try:
            self.send("stop")
        except WorkerError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


def _measure(workers: dict, cell: Cell, stream, steps, warmup, device,
             references: dict) -> None:
    """Fill ``cell``: stock and patched, each in its workers (``workers[variant]``, one list
    of processes per variant), set up side by side (untimed), then timed in alternating blocks
    (so a drift of the machine's speed hits both alike, and only one process uses the GPU at
    a time), against the stock eager model (run once per batch and phase: ``references``).
    With several processes per variant, the ``r``-th of stock and of patched take their turns
    together; decode steps build on the cache of the steps before, so every process runs every
    decode block, while prefills and generate() rounds, each on its own, go to the processes
    in turn (their timing takes no longer than with one process per variant)."""
    compiled = cell.mode != "eager"
    generate = cell.mode == "generate"
    ref_key = (cell.batch, generate, cell.phase)
    variants = ("stock", "patched")
    procs = len(workers["stock"])
    first_timed = warmup if cell.phase == "decode" else min(warmup, 2)
    # The patched workers compile while a stock one runs the reference, then stock's compile
    # too: the host has the cores, and nothing is timed yet.
    for w in workers["patched"]:
        w.send("setup", cell.mode, cell.phase, stream, 0 if generate else first_timed)
    if ref_key not in references:
        references[ref_key] = workers["stock"][0].call("reference", stream, cell.phase,
                                                       generate, warmup + steps)
    ref_logits, ref_first = references[ref_key]
    for w in workers["stock"]:
        w.send("setup", cell.mode, cell.phase, stream, 0 if generate else first_timed)
    for v in variants:
        for w in workers[v]:
            w.result()
    times = {v: [] for v in variants}
    hosts = {v: [] for v in variants}
    core = _timing_core()  # all time on one core, taking turns
    if generate:
        block = 1  # one round per variant at a time
        lo, hi = GENERATE_TOKENS
        for r in range(max(procs, GENERATE_ROUNDS) if device == "cuda" else 1):  # CPU: untimed
            # Per round and variant, the per-token time; the variants' order alternates (in
            # each pair of processes), so a drift of the host's speed within a round favours
            # neither.
            for v in variants if (r // procs) % 2 == 0 else variants[::-1]:
                times[v].append(workers[v][r % procs].call("generate_round", lo, hi, core))
    else:
        def run_block(start: int, stop: int, r: int, turn: int) -> None:
            # The variants' order alternates with the turn, so each process pair runs both
            # orders: a pair's second block read 0.4-2% faster than its first where both
            # variants were stock, or their roles swapped (docs/design.md, "End-to-end bench").
            for v in variants if turn % 2 == 0 else variants[::-1]:
                for wall, host in workers[v][r].call("block", start, stop, core):
                    times[v].append(wall)
                    hosts[v].append(host)

        if cell.phase == "decode":  # every block in every process
            block, n = BLOCK, warmup + steps
            for turn, start in enumerate(range(first_timed, n, block)):
                for r in range(procs):
                    run_block(start, min(n, start + block), r, turn)
        else:  # prefills, each on its own: blocks go to the processes in turn
            block, k = PREFILL_BLOCK, 0
            least = max(procs, prefill_steps(steps))
            most = max(least, PREFILL_MOST) if device == "cuda" else least
            while k * block < least or k % procs or (
                    k * block < most and sum(times["stock"]) < PREFILL_BUDGET_MS):
                start = first_timed + k * block
                run_block(start, start + block, k % procs, k // procs)
                k += 1
    last = {v: [w.call("finish") for w in workers[v]] for v in variants}
    cell.block = block
    cell.stock_times, cell.patched_times = (times[v] for v in variants)
    if not generate:
        cell.stock_host_times, cell.patched_host_times = (hosts[v] for v in variants)
    _score(cell, procs)
    # generate(): compare the first decode step (the one compiled) where every process chose
    # the reference's first token; where a near-tie of random weights made one choose another,
    # that step's inputs differ, so the prompt step (eager in generate) is compared instead.
    step = 1 if generate and all(torch.equal(f[1], ref_first) for v in variants
                                 for f in last[v]) else 0
    ref = ref_logits[step]
    cell.stock_dev, cell.patched_dev = (max(float((f[0][step] - ref).abs().max())
                                            for f in last[v]) for v in variants)
    eager_bar = EAGER_ULPS * _ulp(ref)
    # Compiled: Inductor rounds the rest of the model unlike eager, so the bar is the stock
    # compiled model's own drift.
    cell.allowed_dev = eager_bar if not compiled or (generate and step == 0) else max(
        eager_bar, 2 * cell.stock_dev + _ulp(ref))
    if compiled and not generate:
        # graphs, breaks and recompiles after the warm-up: per variant the most any of its
        # processes had, stock + patched
        cell.graphs, cell.graph_breaks, cell.recompiles_after_warmup = (
            sum(max(f[k] for f in last[v]) for v in variants) for k in (2, 3, 4))


def _score(cell: Cell, processes: int) -> None:
    """A cell's figures from its timed steps: ms per step (:func:`block_median`), host ms
    likewise, and the speed-up's interval (:func:`speedup_interval`)."""
    block = cell.block or 1
    cell.stock_ms, cell.patched_ms = (block_median(t, block)
                                      for t in (cell.stock_times, cell.patched_times))
    if cell.stock_host_times and cell.patched_host_times:
        cell.stock_host_ms, cell.patched_host_ms = (
            block_median(t, block) for t in (cell.stock_host_times, cell.patched_host_times))
    cell.speedup_interval = speedup_interval(cell.stock_times, cell.patched_times, block,
                                             processes=processes)


def run_e2e(presets: Sequence[str], batches: Sequence[int], modes: Sequence[str],
            phases: Sequence[str], layers: int = 4, steps: int = STEPS, warmup: int = 5,
            prefill_len: int = 512, seed: int = 0, progress=None,
            on_update: Callable[[E2EReport], None] | None = None,
            native_wait: float = 0.0, processes: int = 1) -> E2EReport:
    """Every (preset, batch, phase, mode) cell, stock vs patched, each variant in
    ``processes`` worker processes of its own per preset (:class:`_Worker`; spawned, so a
    script calling this does so under ``if __name__ == "__main__":``; several, so that the
    speed of one process's host, which differs from process to process, is not read as the
    variant's: :func:`_measure`). Without a CUDA GPU: a tiny model through Triton's
    interpreter, correctness and graph counts only (no timing)."""
    from .runner import environment

    timed = torch.cuda.is_available()
    device = "cuda" if timed else "cpu"
    report = E2EReport(environment=_environment(environment()), layers=layers, timed=timed,
                       processes=processes)
    cells = [Cell(p, b, ph, m) for p in presets for b in batches for ph in phases for m in modes
             if not (ph == "prefill" and m == "generate")]  # generate() times its own decode
    if progress is not None:
        progress.start(total=len(cells), count=len(cells))
    workers, references = {}, {}

    def stop_workers():
        for w in (w for ws in workers.values() for w in ws):
            w.close()
        workers.clear()
        references.clear()

    try:
        for cell in cells:
            if progress is not None:
                progress.status(f"{cell.preset} batch {cell.batch} {cell.phase} {cell.mode}")
            if workers and workers["stock"][0].preset != cell.preset:
                stop_workers()
            g = torch.Generator(device="cpu").manual_seed(seed + cell.batch)
            length = prefill_len if cell.phase == "prefill" else PROMPT + warmup + steps
            vocab = VOCAB if timed else TINY_VOCAB
            stream = torch.randint(0, vocab, (cell.batch, length), generator=g)
            try:
                if not workers:
                    for v in ("stock", "patched"):
                        workers[v] = [_Worker(v, cell.preset, layers, device, seed, native_wait,
                                              v if processes == 1 else f"{v} {r + 1}")
                                      for r in range(processes)]
                    ready = [(w.variant, w.result()) for ws in workers.values() for w in ws]
                    if len({str(digest) for _, (_, digest) in ready}) != 1:  # models built
                        raise RuntimeError("the workers built different weights from one seed")
                    report.environment["launch_route"] = next(
                        route for v, (route, _) in ready if v == "patched")
                _measure(workers, cell, stream, steps, warmup, device, references)
            except Exception as e:  # noqa: BLE001 - one failing cell is reported, not fatal
                cell.error = str(e) if isinstance(e, WorkerError) else _error_line(e)
                stop_workers()  # a CUDA error poisons a process: the next cell starts afresh
            if not timed:
                cell.stock_ms = cell.patched_ms = cell.speedup_interval = None
                cell.stock_times = cell.patched_times = None
                cell.stock_host_ms = cell.patched_host_ms = None
                cell.stock_host_times = cell.patched_host_times = None
            report.cells.append(cell)
            if on_update is not None:
                on_update(report)
            if progress is not None:
                progress.done(1)
    finally:
        stop_workers()
    if timed and any(c.error is None for c in report.cells):
        from .timing import op_host_times

        report.op_host_us = op_host_times()
    return report


def _environment(env: dict) -> dict:
    import transformers

    return {**env, "transformers": transformers.__version__}


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _f(x, fmt="{:.3f}"):
    return "—" if x is None else fmt.format(x)


def _interval(c: Cell) -> str:
    if c.speedup_interval is None:
        return ""
    lo, hi = c.speedup_interval
    return f" ({lo:.3f}-{hi:.3f})"


def _host(c: Cell) -> str:
    if c.stock_host_ms is None or c.patched_host_ms is None:
        return "—"
    return f"{c.stock_host_ms:.3f} / {c.patched_host_ms:.3f}"


def render_e2e_markdown(report: E2EReport) -> str:
    env = report.environment
    lines = [f"End to end: {report.layers} decoder layers at each preset's width, random "
             f"weights, vocab {VOCAB if report.timed else TINY_VOCAB}, bf16, StaticCache; decode "
             f"step after {PROMPT} tokens, prefill of the given length. "
             + ", ".join(f"{k} {env[k]}" for k in ("gpu", "torch", "triton", "transformers",
                                                    "commit") if env.get(k))
             + (f"; launch route {env['launch_route']}" if env.get("launch_route") else "")
             + ("; stock and patched each in a process of its own" if report.processes == 1
                else f"; stock and patched each in {report.processes} processes of their own, "
                "their times pooled")
             + ("; ms: the median over a variant's blocks of each block's median" if
                report.timed else ""), ""]
    if not report.timed:
        lines += ["No CUDA device: a tiny model through Triton's interpreter, compiled with "
                  "dynamo's eager backend; correctness and graph counts only. Timing needs a "
                  "CUDA GPU.", ""]
    lines += ["| preset | batch | phase | mode | stock ms | patched ms | speed-up (95%) | "
              "host ms stock / patched | max Δlogit stock / patched (allowed) | correct | "
              "graphs / breaks / recompiles |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report.cells:
        if c.error:
            verdict = f"error: {c.error}"
        else:
            verdict = {True: "pass", False: "FAIL", None: "—"}[c.correct]
        graphs = "—" if c.graphs is None else \
            f"{c.graphs} / {c.graph_breaks} / {c.recompiles_after_warmup}"
        lines.append(f"| {c.preset} | {c.batch} | {c.phase} | {c.mode} | {_f(c.stock_ms)} | "
                     f"{_f(c.patched_ms)} | {_f(c.speedup, '{:.2f}×')}{_interval(c)} | "
                     f"{_host(c)} | {_f(c.stock_dev, '{:.3g}')}"
                     f" / {_f(c.patched_dev, '{:.3g}')} ({_f(c.allowed_dev, '{:.3g}')}) | "
                     f"{verdict} | {graphs} |")
    timed = [c for c in report.cells if c.speedup is not None and c.speedup_interval]
    if timed:
        above = sum(c.speedup_interval[0] > 1.0 for c in timed)
        below = sum(c.speedup_interval[1] < 1.0 for c in timed)
        lines += ["", f"Speed-up ≥ 1.0 in {sum(c.speedup >= 1.0 for c in timed)} of "
                  f"{len(timed)} timed cells; 95% intervals: {above} wholly above 1.0, "
                  f"{len(timed) - above - below} holding it (a tie within this run's noise), "
                  f"{below} wholly below."]
    if report.op_host_us:
        h = report.op_host_us
        lines += ["", "Host µs per call of the op (decode #1, outputs given), same process: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in h.items())]
    return "\n".join(lines)


def write_e2e_json(report: E2EReport, path: str | os.PathLike) -> None:
    data = {"environment": report.environment, "layers": report.layers, "timed": report.timed,
            "processes": report.processes, "op_host_us": report.op_host_us,
            "cells": [{**dataclasses.asdict(c), "speedup": c.speedup, "correct": c.correct}
                      for c in report.cells]}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def read_e2e_json(path: str | os.PathLike) -> E2EReport:
    """The report a ``--json`` file of :func:`write_e2e_json` holds, each timed cell's figures
    recomputed from its stored step times by this version's statistics (:func:`_score`), so a
    committed run reads as today's protocol would report it. A file written before cells kept
    their ``block`` takes the run lengths of today's protocol (decode :data:`BLOCK`, prefill
    :data:`PREFILL_BLOCK`, ``generate`` 1), which runs from commit 8e03c68 on used (earlier
    ones timed prefills in blocks of 10: their prefill figures would be read wrongly).
    ValueError: not such a file."""
    try:
        with open(path) as f:
            data = json.load(f)
        names = {f.name for f in dataclasses.fields(Cell)}
        report = E2EReport(environment=data["environment"], layers=data["layers"],
                           timed=data["timed"], op_host_us=data.get("op_host_us") or {},
                           processes=data.get("processes", 1))
        cells = [Cell(**{k: v for k, v in raw.items() if k in names}) for raw in data["cells"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # (JSONDecodeError too)
        raise ValueError(f"not the JSON of `qkrope bench --e2e --json` ({type(e).__name__}: "
                         f"{e})") from None
    for cell in cells:
        if cell.stock_times and cell.patched_times:
            cell.block = cell.block or (1 if cell.mode == "generate" else
                                        BLOCK if cell.phase == "decode" else PREFILL_BLOCK)
            _score(cell, report.processes)
        report.cells.append(cell)
    return report


def write_e2e_plot(report: E2EReport, path: str) -> None:
    """Speed-up (stock ÷ patched time) per cell with its 95% interval, one panel per preset
    and phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c.preset, c.phase) for c in report.cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (preset, phase) in zip(axes[0], panels):
        cells = [c for c in report.cells if (c.preset, c.phase) == (preset, phase)]
        modes = [m for m in MODES if any(c.mode == m for c in cells)]
        batches = sorted({c.batch for c in cells})
        width = 0.8 / max(1, len(modes))
        for k, m in enumerate(modes):
            got = [next((c for c in cells if c.mode == m and c.batch == b), None)
                   for b in batches]
            ys = [(c.speedup or 0) if c else 0 for c in got]
            # the 95% interval as an error bar (none where the cell has none)
            err = [[y - c.speedup_interval[0] if c and c.speedup_interval else 0 for c, y in
                    zip(got, ys)],
                   [c.speedup_interval[1] - y if c and c.speedup_interval else 0 for c, y in
                    zip(got, ys)]]
            ax.bar([i + k * width for i in range(len(batches))], ys, width, label=m, yerr=err,
                   capsize=2, error_kw={"lw": 0.8})
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))],
                      [f"B={b}" for b in batches])
        ax.set_title(f"{preset} {phase}")
        ax.set_ylabel("stock ÷ patched time")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_command(args, console, progress, saved: E2EReport | None = None) -> int:
    """``qkrope bench --e2e`` once its arguments are checked (``cli.py``): runs (or takes the
    ``saved`` report of ``--rescore``), prints the table, writes ``--json``/``--plot``; exit
    status 1 when a cell fails or errs."""
    if saved is not None:
        return _finish(args, console, saved, saved.timed)
    timed = torch.cuda.is_available()
    presets = [args.model] if args.model else list(PRESETS)
    if not timed:
        presets = presets[:1]
        console.print("No CUDA device: a tiny model of the first preset's family through "
                      "Triton's interpreter (correctness, graph breaks, recompiles). Timing "
                      "needs a CUDA GPU.", highlight=False, markup=False)
    else:
        from ..ops import _native

        if _native.enabled() and args.native_wait > 0:
            _native.load(timeout=args.native_wait)  # time the launch route users get
        console.print(f"launch route: {_native.status()}", highlight=False, markup=False)

    def keep(report) -> None:
        if args.json:
            write_e2e_json(report, args.json)

    with progress:
        report = run_e2e(presets, args.batch or ([1, 8, 64] if timed else [1, 2]),
                         args.modes or list(MODES), args.phases or list(PHASES),
                         layers=args.layers if timed or args.layers != 4 else 2,
                         steps=args.steps if timed or args.steps != STEPS else 3,
                         warmup=5 if timed else 2,
                         prefill_len=args.prefill_len if timed or args.prefill_len != 512
                         else 24, seed=args.seed, progress=progress, on_update=keep,
                         native_wait=args.native_wait if timed else 0.0,
                         processes=args.processes or (PROCESSES if timed else 1))
    keep(report)
    return _finish(args, console, report, timed)


def _finish(args, console, report: E2EReport, timed: bool) -> int:
    """Print the table, write ``--json`` (once more) and ``--plot``; the exit status."""
    if args.json and args.rescore:  # (a run wrote it as it went)
        write_e2e_json(report, args.json)
    print(render_e2e_markdown(report))
    if args.plot:
        if timed:
            write_e2e_plot(report, args.plot)
            console.print(f"wrote {args.plot}", highlight=False, markup=False)
        else:
            console.print(f"--plot {args.plot}: nothing timed without a CUDA GPU, no plot "
                          "written", highlight=False, markup=False)
    if args.json:
        console.print(f"wrote {args.json}", highlight=False, markup=False)
    return 1 if any(c.error or c.correct is False for c in report.cells) else 0
