"""benchmarks/quant_table.py, issue 26's table of record: ratios from `device_session.sh
quant`'s files, a wrong row or a failed run named and failing the exit status."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quant_table",
                                               ROOT / "benchmarks" / "quant_table.py")
quant_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quant_table)

HEAD = ("| # | S | C | B | tokens | floor µs | copy µs | qkrope µs | p20–p80 | % copy BW | "
        "% of copy | % spec BW | correct |\n|" + "---|" * 13)


def section(layout: str, mode: str, rows: list[tuple[float, str]]) -> str:
    """One ``## LAYOUT MODE`` section as the quant step writes it: the bench table, then the
    host table, whose rows must not be read as timings."""
    body = "\n".join(f"| {i} | 1 | 0 | 1 | 1 | 0.01 | 1.00 | {us} | 1–2 | 1% | 90% | 1% | {ok} |"
                     for i, (us, ok) in enumerate(rows, 1))
    host = "\n".join(f"| {i} | 1 | 27.4 | 2.00 | — |" for i in range(1, len(rows) + 1))
    return (f"## {layout} {mode}\n\nqkrope bench — header\n\n{HEAD}\n{body}\n\nGeometric mean\n\n"
            f"| # | tokens | qkrope host | qkrope × add_ | qkrope graph |\n|---|---|---|---|---|\n"
            f"{host}\n\nrc=0\n\n")


def test_ratios_geomeans_and_bold_above_the_bound(tmp_path):
    (tmp_path / "quant-bhsd.md").write_text(
        section("bhsd", "bf16", [(2.0, "pass"), (8.0, "pass")])
        + section("bhsd", "fp8", [(2.2, "pass"), (8.0, "pass")]))
    (tmp_path / "quant-paged.md").write_text(
        section("paged", "bf16", [(4.0, "pass")]) + section("paged", "fp8", [(4.1, "pass")]))
    runs = {layout: quant_table.parse((tmp_path / f"quant-{layout}.md").read_text())
            for layout in ("bhsd", "paged")}
    assert runs["bhsd"]["fp8"] == {"1": (2.2, "90%", True), "2": (8.0, "90%", True)}
    text, problems = quant_table.table(runs)
    assert problems == []
    lines = text.splitlines()
    assert lines[2].startswith("| 1 | 2.00 | 2.20 | **1.100** |")  # above 1.05: bold
    assert lines[3].startswith("| 2 | 8.00 | 8.00 | 1.000 |")
    # geomean ratio sqrt(1.1 * 1.0) = 1.0488: not bold
    assert lines[4].startswith("| bhsd geomean | 4.00 | 4.20 | 1.049 |")
    assert lines[5].startswith("| p1 | 4.00 | 4.10 | 1.025 |")
    assert quant_table.main([str(tmp_path)]) == 0


def test_wrong_rows_and_failed_runs_are_named(tmp_path, capsys):
    (tmp_path / "quant-bhsd.md").write_text(
        section("bhsd", "bf16", [(2.0, "pass"), (8.0, "pass")])
        + section("bhsd", "fp8", [(2.0, "pass"), (8.0, "FAIL")])
        + "## bhsd int8-pth\n\nTraceback: the run failed\nrc=1\n\n")
    assert quant_table.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "- bhsd fp8 row 2: wrong after dequantisation" in out
    assert "- bhsd int8-pth: no timings (did its run fail?)" in out
    assert "| 1 | 2.00 | 2.00 | 1.000 | — | — |" in out


def test_no_files_is_a_usage_error(tmp_path):
    assert quant_table.main([str(tmp_path)]) == 2
