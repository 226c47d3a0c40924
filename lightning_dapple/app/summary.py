"""Per-run results and the sweep summary of ``dapple-train -m ...``.

Every run writes ``result.json`` into its run directory (status, plan, median step time
after warm-up, the step the simulator predicts for the plan that ran, peak stashed bytes
over all ranks, final losses and metrics). Runs that fail on bad configuration leave no run
directory; they are recorded in memory instead (``RESULTS``: Hydra's basic launcher runs the
jobs of a sweep in this process). All jobs of one sweep share one directory
(``multirun/<time>/<job>_<recipe>/``, whatever recipe each job runs), so one summary covers
the whole sweep. After the sweep, Hydra calls ``SweepSummary.on_multirun_end``: a rich table
on the console, ``summary.csv`` and ``summary.txt`` (the table as text) in the sweep
directory.

The table puts the measured step beside the simulated one, so that a sweep shows how far
the simulator (the planner's latency model, DAPPLE paper section 4) is from the runs;
where the simulator's fastest run is not the measured fastest, one sentence under the
table says so. The ``tuning`` column reports what the strategy's
measured choice between candidate plans kept or changed (``plan.extra["tuning"]``).
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback

from lightning_dapple.app.report import summary_table
from lightning_dapple.atomic_files import atomic_write_text as write_text
from lightning_dapple.plan.console import make_console, render_text
from lightning_dapple.units import format_bytes

__all__ = [
    "RESULTS",
    "SUMMARY_COLUMNS",
    "SweepSummary",
    "collect_results",
    "ranking_note",
    "summarize",
    "tuning_label",
    "write_summary",
]

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
    "executor_step_ms",
    "simulated_step_ms",
    "measured_over_simulated",
    "tuning",
    "peak_stash_bytes",
    "peak_memory_bytes",
    "train_loss",
    "val_loss",
    "steps",
    "run_dir",
    "error",
)


def collect_results(sweep_dir: Path) -> list[dict[str, Any]]:
    """This sweep's results: the in-memory records, else every ``<job>_<recipe>/result.json``
    (any direct subdirectory) in ``sweep_dir``, ordered by job number."""
    sweep_dir = Path(sweep_dir).resolve()
    mine = [r for r in RESULTS if r.get("sweep_dir") and Path(r["sweep_dir"]).resolve() == sweep_dir]
    if mine:
        return sorted(mine, key=_job_order)
    found = []
    for path in sorted(sweep_dir.glob("*/result.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(found, key=_job_order)


def _job_order(result: dict[str, Any]) -> tuple[bool, int]:
    job = result.get("job")
    return (not isinstance(job, int), job if isinstance(job, int) else 0)


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
        measured, simulated = result.get("median_step_ms"), result.get("simulated_step_ms")
        rows.append(
            {
                "job": result.get("job"),
                "overrides": " ".join(overrides),
                "status": result.get("status"),
                "plan": plan.get("kind"),
                "micro_batches": plan.get("micro_batches"),
                "schedule": plan.get("schedule"),
                "median_step_ms": _round(measured, 2),
                "executor_step_ms": _round((result.get("median_phase_ms") or {}).get("executor"), 2),
                "simulated_step_ms": _round(simulated, 2),
                "measured_over_simulated": _ratio(measured, simulated),
                "tuning": tuning_label(plan.get("tuning")),
                "peak_stash_bytes": result.get("peak_stash_bytes"),
                "peak_memory_bytes": max(result.get("peak_memory_bytes_per_rank") or [], default=None),
                "train_loss": _round(metrics.get("train_loss"), 4),
                "val_loss": _round(metrics.get("val_loss"), 4),
                "steps": result.get("steps"),
                "run_dir": result.get("run_dir"),
                "error": result.get("error"),
            }
        )
    return rows


def _round(value: Any, digits: int) -> Any:
    return round(float(value), digits) if _is_number(value) else value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ratio(measured: Any, simulated: Any) -> float | None:
    """Measured over simulated step, 2 decimals: above 1 the run was slower than predicted."""
    if not (_is_number(measured) and _is_number(simulated)) or simulated <= 0:
        return None
    return round(float(measured) / float(simulated), 2)


def tuning_label(record: Any) -> str:
    """The ``tuning`` column: empty without a record; ``kept <plan>`` when the measured choice
    is the simulator's; ``measured <chosen> over <simulator's choice>`` when measuring changed it."""
    if not isinstance(record, dict) or record.get("chosen") is None:
        return ""
    chosen, predicted = record["chosen"], record.get("simulator_choice")
    if predicted is None or chosen == predicted:
        return f"kept {chosen}"
    return f"measured {chosen} over {predicted}"


def ranking_note(rows: Sequence[dict[str, Any]]) -> str | None:
    """One sentence when the simulator's fastest run is not the measured fastest, else None.

    Ranked are the ``ok`` rows with both a measured and a simulated step (a run without a
    simulated figure is not ranked); with fewer than two there is nothing to compare. The
    rankings agree when one run is fastest (ties included) in both."""
    ranked = [r for r in rows if r.get("status") == "ok" and _is_number(r.get("median_step_ms")) and _is_number(r.get("simulated_step_ms"))]
    if len(ranked) < 2:
        return None
    best_simulated = min(r["simulated_step_ms"] for r in ranked)
    best_measured = min(r["median_step_ms"] for r in ranked)
    by_simulator = [r for r in ranked if r["simulated_step_ms"] == best_simulated]
    by_measurement = [r for r in ranked if r["median_step_ms"] == best_measured]
    if any(r in by_measurement for r in by_simulator):
        return None
    simulated, measured = by_simulator[0], by_measurement[0]
    return (
        f"The simulator ranks job {simulated.get('job')} fastest ({best_simulated:.2f} ms simulated); "
        f"measured, job {measured.get('job')} is fastest ({best_measured:.2f} ms)."
    )


def write_summary(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(SUMMARY_COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row.get(key) for key in SUMMARY_COLUMNS})
    return write_text(path, buffer.getvalue())


def rich_summary(rows: Sequence[dict[str, Any]], title: str) -> Any:
    shown = [
        {**row, **{key: format_bytes(row.get(key)) if row.get(key) is not None else None for key in ("peak_stash_bytes", "peak_memory_bytes")}}
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
        ("executor_step_ms", "of which executor ms"),
        ("simulated_step_ms", "step ms (simulated)"),
        ("measured_over_simulated", "measured / simulated"),
        ("tuning", "tuning"),
        ("peak_stash_bytes", "peak stash (max rank)"),
        ("peak_memory_bytes", "peak memory (max rank)"),
        ("train_loss", "train_loss"),
    ]
    return summary_table(shown, columns, title)


class SweepSummary(HydraCallback):
    """Hydra callback: after ``-m``, print the runs' measured and simulated step times and
    stash peaks, and a sentence where the simulator ranks another run fastest; write
    summary.csv and summary.txt."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        results = collect_results(sweep_dir)
        if not results:
            return
        rows = summarize(results)
        note = ranking_note(rows)
        if sweep_dir.is_dir():
            write_summary(rows, sweep_dir / "summary.csv")
            table = rich_summary(rows, f"sweep summary ({sweep_dir})")
            write_text(sweep_dir / "summary.txt", render_text(table) + (f"{note}\n" if note else ""))
        else:
            table = rich_summary(rows, "sweep summary")
        console = make_console()
        console.print(table)
        if note:
            console.print(note, markup=False, highlight=False)
