"""Issue 26's table of record: each quantised output mode's GPU time as a ratio to the
bf16-output op's, per suite and paged row, from the files `device_session.sh quant` writes.

    python benchmarks/quant_table.py DIR        # DIR holds quant-bhsd.md and quant-paged.md

Each file is a run of ``## LAYOUT MODE`` sections, one ``qkrope bench --impl qkrope`` output
each; a row's time is its ``qkrope µs`` column, found by the header's names. Prints one
markdown table (the format of BENCHMARKS.md, "Quantised outputs against the bf16-output op"):
per row the bf16 time, each mode's time and ratio (bold above the issue's 1.05), each mode's
"% of copy" (the same bytes copied in the same process: under 100% is slower than that copy),
and a geomean row per layout. A row a mode got wrong, or a mode whose run failed, is named
under the table; the exit status is then 1. No GPU needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import geometric_mean

BOUND = 1.05  # issue 26, item 5: each quantised mode at most 1.05x the bf16 op's time
LAYOUTS = {"bhsd": "", "paged": "p"}  # layout -> the row label's prefix (benchmarks/README.md)


def parse(text: str) -> dict[str, dict[str, tuple[float, str, bool]]]:
    """``{mode: {row: (µs, "% of copy", correct)}}`` of one layout's file; a section whose run
    printed no table (a failed run) maps to ``{}``."""
    modes: dict[str, dict[str, tuple[float, str, bool]]] = {}
    for section in text.split("\n## "):
        words = section.lstrip("# \n").split("\n", 1)[0].split()
        if len(words) != 2 or words[0] not in LAYOUTS:
            continue
        rows: dict[str, tuple[float, str, bool]] = {}
        cols: list[str] = []
        for line in section.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[:1] == ["#"]:
                cols = cells  # a header: the bench table's, or the host table's after it
            elif cols and "qkrope µs" in cols and cells[0].isdigit() and len(cells) == len(cols):
                rows[cells[0]] = (float(cells[cols.index("qkrope µs")]),
                                  cells[cols.index("% of copy")],
                                  cells[cols.index("correct")] == "pass")
        modes[words[1]] = rows
    return modes


def table(runs: dict[str, dict[str, dict[str, tuple[float, str, bool]]]]) -> tuple[str, list[str]]:
    """The markdown table of ``{layout: parse(file)}`` and the list of problems found."""
    problems: list[str] = []
    modes = [m for m in dict.fromkeys(m for by_mode in runs.values() for m in by_mode)
             if m != "bf16"]
    ratio = lambda r: f"**{r:.3f}**" if r > BOUND else f"{r:.3f}"  # noqa: E731
    head = ["row", "bf16 µs"] + [f"{m} {x}" for m in modes for x in ("µs", "÷ bf16")] \
        + [f"{m} % of copy" for m in ["bf16"] + modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for layout, by_mode in runs.items():
        base = by_mode.get("bf16")
        if not base:
            problems.append(f"{layout}: no bf16 run to compare with")
            continue
        problems += [f"{layout} {m}: no timings (did its run fail?)" for m in modes
                     if not by_mode.get(m)]
        for row, (us, pct, good) in base.items():
            if not good:
                problems.append(f"{layout} bf16 row {row}: wrong")
            cells, pcts = [LAYOUTS[layout] + row, f"{us:.2f}"], [pct]
            for m in modes:
                mus, mpct, mgood = by_mode.get(m, {}).get(row, (None, "—", True))
                cells += ["—", "—"] if mus is None else [f"{mus:.2f}", ratio(mus / us)]
                pcts.append(mpct)
                if not mgood:
                    problems.append(f"{layout} {m} row {row}: wrong after dequantisation")
            lines.append("| " + " | ".join(cells + pcts) + " |")
        g0 = geometric_mean(v[0] for v in base.values())
        cells = [f"{layout} geomean", f"{g0:.2f}"]
        for m in modes:
            got = by_mode.get(m, {})
            g = geometric_mean(v[0] for v in got.values()) if got.keys() == base.keys() else None
            cells += ["—", "—"] if g is None else [f"{g:.2f}", ratio(g / g0)]
        lines.append("| " + " | ".join(cells + [""] * (1 + len(modes))) + " |")
    return "\n".join(lines), problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="the folder holding quant-bhsd.md and quant-paged.md")
    args = ap.parse_args(argv)
    runs = {layout: parse(path.read_text()) for layout in LAYOUTS
            if (path := args.dir / f"quant-{layout}.md").exists()}
    if not runs:
        print(f"no quant-bhsd.md or quant-paged.md in {args.dir}", file=sys.stderr)
        return 2
    text, problems = table(runs)
    print(text)
    for p in problems:
        print(f"- {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
