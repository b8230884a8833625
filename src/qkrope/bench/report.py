"""A benchmark run's results and their outputs: the result objects, the markdown table, JSON
and the plot. Everything here works on plain result objects, so it is tested without a GPU."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from .env import spec_bandwidth

__all__ = ["ImplResult", "WorkloadResult", "BenchReport", "render_markdown", "write_json",
           "write_plot"]


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


def _rounds(report) -> str:
    n = report.settings.get("check_rounds", 1)
    return f"{n} round{'s' if n != 1 else ''} of fresh random inputs"


def render_markdown(report: BenchReport, main: str | None = None) -> str:
    """The report as markdown: the per-workload table, geomeans, host/graph times, notes.
    ``main``: the implementation the others are compared with (qkrope when it ran, else the
    first that did)."""
    if main is None:
        main = "qkrope" if "qkrope" in report.impls or not report.impls else report.impls[0]
    lines = []
    env = report.environment
    layout = report.settings.get("layout", "bhsd")
    quant = report.settings.get("quant", "bf16 caches and outputs")
    lines.append(f"qkrope bench — {env.get('gpu') or 'no CUDA device'} — layout {layout} — "
                 + (f"{quant} — " if quant != "bf16 caches and outputs" else "")
                 + f"model {report.model} "
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
                     f"written), timed the same way; % of copy = that / {main} µs. Each "
                     "implementation was checked against qkrope.reference on "
                     f"{_rounds(report)} per workload (spec.md §2), the first also timed.")
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
                     + ("; cache length C+S" if layout == "bhsd" else "")
                     + f"; {_rounds(report)} per workload), at {plan}. "
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
