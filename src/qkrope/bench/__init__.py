"""``qkrope bench``: checks against the reference, GPU timing (CUPTI, L2 flushed, median), the
bandwidth floor, baselines, the markdown table, JSON and plot."""

from .runner import (
    BenchReport, CheckPlan, Progress, check_plan, render_markdown, run_benchmark, sweep_workloads,
    write_json, write_plot,
)

__all__ = ["BenchReport", "CheckPlan", "Progress", "check_plan", "render_markdown",
           "run_benchmark", "sweep_workloads", "write_json", "write_plot"]
