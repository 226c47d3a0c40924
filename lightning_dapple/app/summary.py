"""Per-run results and the sweep summary of ``dapple-train -m ...``.

Every run writes ``result.json`` into its run directory (status, plan, median step time
after warm-up, peak stashed bytes over all ranks, final losses and metrics). Runs that
fail on bad configuration leave no run directory; they are recorded in memory instead
(``RESULTS``: Hydra's basic launcher runs the jobs of a sweep in this process). After the
sweep, Hydra calls ``SweepSummary.on_multirun_end``: a rich table on the console and
``summary.csv`` in the sweep directory.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from hydra.experimental.callback import Callback as HydraCallback

from lightning_dapple.app.report import summary_table
from lightning_dapple.atomic_files import atomic_write_text as write_text
from lightning_dapple.plan.console import make_console, render_text
from lightning_dapple.units import format_bytes

__all__ = ["RESULTS", "SUMMARY_COLUMNS", "SweepSummary", "collect_results", "summarize", "write_summary"]

# Results of the jobs run by this process (successful and failed), in order.
RESULTS: list[dict[str, Any]] = []

SUMMARY_COLUMNS: tuple[str, ...] = (
    "job",
    "overrides",
    "status",
    "plan",
    "micro_batches",
    "schedule",
    "median_step_ms",
    "peak_stash_bytes",
    "train_loss",
    "val_loss",
    "steps",
    "run_dir",
    "error",
)


def collect_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """This sweep's results: the in-memory records, else every ``*/result.json`` in ``sweep_dir``."""
    sweep_dir = Path(sweep_dir).resolve()
    mine = [r for r in RESULTS if r.get("sweep_dir") and Path(r["sweep_dir"]).resolve() == sweep_dir]
    if mine:
        return sorted(mine, key=lambda r: (r.get("job") is None, r.get("job")))
    found = []
    for path in sorted(sweep_dir.glob("*/result.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(found, key=lambda r: (r.get("job") is None, r.get("job")))


def _varying(results: Sequence[dict[str, Any]]) -> list[str]:
    """Override keys whose values differ between jobs (those name the runs)."""
    values: dict[str, set[str]] = {}
    for result in results:
        for item in result.get("overrides", []):
            key, _, value = str(item).partition("=")
            values.setdefault(key, set()).add(value)
    return [key for key, seen in values.items() if len(seen) > 1 or len(results) == 1]


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per run with the ``SUMMARY_COLUMNS``."""
    keys = _varying(results)
    rows = []
    for result in results:
        overrides = [o for o in result.get("overrides", []) if str(o).partition("=")[0] in keys]
        plan = result.get("plan") or {}
        metrics = result.get("metrics") or {}
        rows.append(
            {
                "job": result.get("job"),
                "overrides": " ".join(overrides),
                "status": result.get("status"),
                "plan": plan.get("kind"),
                "micro_batches": plan.get("micro_batches"),
                "schedule": plan.get("schedule"),
                "median_step_ms": _round(result.get("median_step_ms"), 2),
                "peak_stash_bytes": result.get("peak_stash_bytes"),
                "train_loss": _round(metrics.get("train_loss"), 4),
                "val_loss": _round(metrics.get("val_loss"), 4),
                "steps": result.get("steps"),
                "run_dir": result.get("run_dir"),
                "error": result.get("error"),
            }
        )
    return rows


def _round(value: Any, digits: int) -> Any:
    return round(float(value), digits) if isinstance(value, (int, float)) else value


def write_summary(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(SUMMARY_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row.get(key) for key in SUMMARY_COLUMNS})
    return write_text(path, buffer.getvalue())


def rich_summary(rows: Sequence[dict[str, Any]], title: str) -> Any:
    shown = [
        {**row, "peak_stash_bytes": format_bytes(row.get("peak_stash_bytes")) if row.get("peak_stash_bytes") is not None else None}
        for row in rows
    ]
    columns = [
        ("job", "job"),
        ("overrides", "overrides"),
        ("status", "status"),
        ("plan", "plan"),
        ("micro_batches", "M"),
        ("schedule", "schedule"),
        ("median_step_ms", "step ms (median)"),
        ("peak_stash_bytes", "peak stash (max rank)"),
        ("train_loss", "train_loss"),
    ]
    return summary_table(shown, columns, title)


class SweepSummary(HydraCallback):
    """Hydra callback: after ``-m``, print the runs' step times and stash peaks; write summary.csv."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        results = collect_results(sweep_dir)
        if not results:
            return
        rows = summarize(results)
        if sweep_dir.is_dir():
            write_summary(rows, sweep_dir / "summary.csv")
            table = rich_summary(rows, f"sweep summary ({sweep_dir})")
            write_text(sweep_dir / "summary.txt", render_text(table))
        else:
            table = rich_summary(rows, "sweep summary")
        make_console().print(table)
