"""Rich tables (plan, run summary) and atomic file writes shared by the app's parts."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

from rich.table import Table

__all__ = ["format_bytes", "plan_table", "summary_table", "write_text"]


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def format_bytes(num: float | None) -> str:
    if num is None:
        return "-"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def plan_table(plan: Any, title: str | None = None) -> Any:
    """One row per stage: layers, devices (global ranks), replicas, K_i, recomputation."""
    head = f"M={plan.micro_batches}, micro-batch {plan.micro_batch_size}, schedule {plan.schedule}, policy {plan.policy}"
    if getattr(plan, "ooo", False):
        head += ", out-of-order backprop"
    table = Table(title=title or f"dapple plan ({plan.kind()})", caption=head)
    for column in ("stage", "layers", "#layers", "devices (ranks)", "replicas", "K_i", "recompute"):
        table.add_column(column, justify="right" if column in ("stage", "#layers", "replicas", "K_i") else "left")
    memory = list(plan.predicted.memory_bytes) if plan.predicted is not None else []
    if memory:
        table.add_column("predicted memory", justify="right")
    for index, stage in enumerate(plan.stages):
        row = [
            str(index),
            f"[{stage.start}, {stage.end})",
            str(stage.end - stage.start),
            _ranks(stage.devices),
            str(stage.replicas),
            "-" if stage.warmup is None else str(stage.warmup),
            stage.recompute,
        ]
        if memory:
            row.append(format_bytes(memory[index]) if index < len(memory) else "-")
        table.add_row(*row)
    if plan.predicted is not None:
        pred = plan.predicted
        parts = [f"predicted step {pred.latency_ms:.2f} ms (formula)"]
        if pred.simulated_latency_ms is not None:
            parts.append(f"{pred.simulated_latency_ms:.2f} ms (simulated)")
        if pred.bubble_fraction is not None:
            parts.append(f"bubble {100 * pred.bubble_fraction:.1f}%")
        table.caption = head + "\n" + ", ".join(parts)
    return table


def _ranks(devices: Sequence[int]) -> str:
    devices = list(devices)
    if len(devices) > 2 and devices == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


def summary_table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]], title: str) -> Any:
    """A rich table of ``rows`` (dicts) with ``columns`` as (key, header) pairs."""
    table = Table(title=title)
    for _, header in columns:
        table.add_column(header)
    for row in rows:
        table.add_row(*("-" if row.get(key) is None else str(row.get(key)) for key, _ in columns))
    return table

