"""``qkrope bench``: SPEC.md §3 timing, the §4 floor, baselines, table, JSON and plot."""

from .runner import BenchReport, render_markdown, run_benchmark, sweep_workloads, write_json, write_plot

__all__ = ["BenchReport", "render_markdown", "run_benchmark", "sweep_workloads", "write_json",
           "write_plot"]
