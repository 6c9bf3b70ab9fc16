"""The end-of-run summary on the console: a few tables a person reads at a glance."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _pairs(title: str, rows: dict[str, Any]) -> Table:
    table = Table(
        title=title, title_justify="left", show_header=False, box=None, padding=(0, 2), min_width=40
    )
    for key, value in rows.items():
        table.add_row(str(key), f"{value:.4g}" if isinstance(value, float) else str(value))
    return table


def print_summary(summary: dict[str, Any], console: Console) -> None:
    """Print the run summary: totals, stop reasons, turns, env failures, per-turn timings."""
    scalars = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    console.print(_pairs("run", scalars))
    for key in (
        "stop_reasons",
        "turns/histogram",
        "env_failures/by_kind",
        "reward/by_data_source",
        "errors/by_kind",
        "errors/top",
    ):
        if summary.get(key):
            console.print(_pairs(key, summary[key]))
    timings = summary.get("time/turn_seconds") or {}
    if timings:
        table = Table(title="seconds per turn", title_justify="left", box=None, padding=(0, 2))
        for column in ("phase", "mean", "p50", "p90", "p99", "max"):
            table.add_column(column)
        for phase, stats in timings.items():
            table.add_row(phase, *(f"{stats.get(c, 0.0):.4f}" for c in ("mean", "p50", "p90", "p99", "max")))
        console.print(table)
