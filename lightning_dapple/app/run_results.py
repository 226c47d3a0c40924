"""What a finished ``dapple-train`` run reports: the outputs its callbacks left in the run
directory, the plan that ran, the loss curve, and the summary table printed at the end."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rich.table import Table

from lightning_dapple.app.callbacks import MEASURED_TIMELINE, SIMULATED_TIMELINE
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.units import format_bytes

__all__ = ["loss_curve", "plan_record", "print_run_summary", "read_json", "run_outputs", "simulator_advice"]


def run_outputs(run_dir: Path) -> dict[str, Any]:
    """What the run's callbacks left in ``run_dir``: the measured step times, the step the
    simulator predicts for the plan on its measured profile, and the timeline pictures."""
    steps = read_json(run_dir / "step_times.json") or {}
    simulated = read_json(run_dir / "timeline_simulated.json") or {}
    return {
        "steps": steps.get("steps"),
        "median_step_ms": steps.get("median_step_ms"),
        "median_phase_ms": steps.get("median_phase_ms"),
        "peak_stash_bytes": steps.get("peak_stash_bytes"),
        "peak_memory_bytes_per_rank": steps.get("peak_memory_bytes_per_rank"),
        "peak_memory_kind": steps.get("peak_memory_kind"),
        "simulated_step_ms": simulated.get("latency_ms"),
        "timelines": [str(run_dir / name) for name in (SIMULATED_TIMELINE, MEASURED_TIMELINE) if (run_dir / name).is_file()],
    }


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def plan_record(path: Path) -> dict[str, Any] | None:
    """The plan that ran, as the run's result records it; with ``tuning`` where the strategy
    chose between candidate plans by measuring them (its ``extra["tuning"]`` record)."""
    data = read_json(path)
    if data is None:
        return None
    plan = plan_from_dict(data)
    record = {
        "kind": plan.kind(),
        "micro_batches": plan.micro_batches,
        "schedule": plan.schedule,
        "policy": plan.policy,
        "stages": [{"layers": list(s.layers), "devices": list(s.devices), "warmup": s.warmup} for s in plan.stages],
        "reason": plan.reason,
        "planner": plan.planner,
    }
    if plan.extra.get("tuning") is not None:
        record["tuning"] = plan.extra["tuning"]
    return record


def loss_curve(path: Path) -> list[float]:
    """``train_loss`` per logged step from Lightning's metrics.csv."""
    if not path.is_file():
        return []
    out: list[tuple[int, float]] = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("train_loss"):
                out.append((int(row["step"]), float(row["train_loss"])))
    return [loss for _, loss in sorted(out)]


#: how far the executor's step may be from the simulated one before the summary says so (the simulator's target)
SIMULATOR_TOLERANCE = 0.15


def simulator_advice(result: dict[str, Any]) -> str:
    """A line for a run whose plan the planner chose by simulation alone and whose executor's
    step (what the simulator prices) measured more than ``SIMULATOR_TOLERANCE`` away from
    the simulated step: then another candidate may have run faster, and only measuring them
    tells (``strategy.tune_steps``). Empty for a plan given by hand, a tuned plan, or a step
    the simulator priced within the tolerance."""
    plan = result.get("plan") or {}
    executor_ms = (result.get("median_phase_ms") or {}).get("executor")
    simulated_ms = result.get("simulated_step_ms")
    if plan.get("planner", "manual") == "manual" or plan.get("tuning") is not None or not executor_ms or not simulated_ms:
        return ""
    ratio = executor_ms / simulated_ms
    if abs(ratio - 1.0) <= SIMULATOR_TOLERANCE:
        return ""
    return (
        f"the executor's step measured {ratio:.2f} x the simulated step, so the planner's ranking of plans may not hold here; "
        "strategy.tune_steps=N runs its best few plans N steps each and keeps the fastest measured"
    )


def print_run_summary(result: dict[str, Any]) -> None:
    """The run's plan, its measured and simulated step side by side, metrics, and where the
    timeline pictures are."""
    plan = result.get("plan") or {}
    table = Table(title=f"{result.get('name')}: {result.get('run_dir')}", show_header=False)
    table.add_column("what")
    table.add_column("value")
    split = ":".join(str(stage["layers"][1] - stage["layers"][0]) for stage in plan.get("stages") or [])
    layers = f" (layers {split})" if split else ""
    table.add_row("plan", f"{plan.get('kind')}{layers}, M={plan.get('micro_batches')}, schedule {plan.get('schedule')}")
    table.add_row("steps", str(result.get("steps")))
    if result.get("median_step_ms") is not None:
        table.add_row("step time, measured (median after warm-up)", f"{result['median_step_ms']:.2f} ms")
    executor_ms = (result.get("median_phase_ms") or {}).get("executor")
    if executor_ms:
        table.add_row("of which the executor's step (what the simulator prices)", f"{executor_ms:.2f} ms")
    if result.get("simulated_step_ms") is not None:
        table.add_row("step time, simulated (the plan on its profile)", f"{result['simulated_step_ms']:.2f} ms")
    advice = simulator_advice(result)
    if advice:
        table.add_row("simulated against measured", advice)
    table.add_row("peak stash (max over ranks)", format_bytes(result.get("peak_stash_bytes")))
    per_rank = result.get("peak_memory_bytes_per_rank")
    if per_rank:
        table.add_row(f"peak memory per rank, {result.get('peak_memory_kind')}", " / ".join(format_bytes(each) for each in per_rank))
    for key in sorted(result.get("metrics") or {}):
        table.add_row(key, f"{result['metrics'][key]:.4f}")
    table.add_row("wall time", f"{result.get('wall_s')} s")
    for path in result.get("timelines") or []:
        table.add_row("timeline picture", path)
    make_console().print(table)
