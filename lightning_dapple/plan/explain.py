"""The plan as a person reads it: a rich table of stages and a summary of why.

DAPPLE 6.2 explains plans by their shape (DP, straight, P:Q), split position and the
balance of AllReduce against pipeline bubbles; the table shows the numbers behind that
(per-stage F/B per micro-batch, AllReduce, memory per device against the budget) and the
summary the predicted phases (formulas 1-2), the simulated latency and the planner's reason.
Each stage also shows its ZeRO level (``costs.py``: the optimizer state a replica keeps) and
how many NCCL communicators each of its ranks makes (``communicators.py``: at most, over
its ranks), whose reserve the memory column includes where the planner priced one
(``extra["communicators"]``).
"""
from __future__ import annotations

from rich.table import Table

from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.plan.communicators import communicators_per_rank
from lightning_dapple.plan.costs import stage_costs, stage_memory_bytes
from lightning_dapple.plan.plan import Plan
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.units import format_bytes


def _devices(devices: tuple[int, ...]) -> str:
    if len(devices) > 2 and list(devices) == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


def plan_table(plan: Plan, profile: ModelProfile | None = None, cluster: Cluster | None = None) -> Table:
    """Stages, layers, devices, replication, K_i, per-micro-batch costs and memory.

    Without the model's profile and the cluster (a plan read alone) the costs are unknown:
    the table then shows what the plan itself holds, and the memory its planner predicted."""
    if profile is None or cluster is None:
        return _plan_only_table(plan)
    plan = plan.with_warmups()
    costs = stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)
    counts = communicators_per_rank(plan, profile.tied)
    reserve = float(plan.extra.get("communicators", {}).get("reserve_bytes", 0.0))
    estimate = " (ESTIMATE)" if profile.estimated else ""
    title = f"{plan.kind()} plan for {profile.name}{estimate}: M={plan.micro_batches}, schedule={plan.schedule}, policy={plan.policy}"
    table = Table(title=title)
    columns = ("stage", "layers", "first .. last layer", "devices", "x", "K", "F ms", "B ms", "send ms", "AllReduce ms (exposed)", "optimizer ms",
               "memory/device", "recompute", "zero", "NCCL comms")
    for column in columns:
        table.add_column(column, justify="right" if column not in ("first .. last layer", "devices") else "left")
    for index, (stage, cost) in enumerate(zip(plan.stages, costs)):
        in_flight = plan.micro_batches if schedule_spec(plan.schedule).holds_every_micro_batch else int(stage.warmup or 1)
        comms = max(counts[rank] for rank in stage.devices)
        memory = stage_memory_bytes(cost, in_flight, cluster) + comms * reserve
        names = f"{profile.layers[stage.start].name[:18]} .. {profile.layers[stage.end - 1].name[:18]}"
        over = " [red]> budget[/red]" if memory > cluster.device_memory_bytes else ""
        table.add_row(
            str(index), f"[{stage.start}, {stage.end})", names, _devices(stage.devices), str(stage.replicas), str(stage.warmup),
            f"{cost.forward_ms:.2f}", f"{cost.backward_ms:.2f}", f"{cost.send_ms:.2f}", f"{cost.allreduce_ms:.1f} ({cost.exposed_allreduce_ms:.1f})",
            f"{cost.optimizer_ms:.2f}", _memory_cell(memory, cluster.device_memory_bytes) + over, stage.recompute, str(stage.zero), str(comms),
        )
    return table


def _plan_only_table(plan: Plan) -> Table:
    """One row per stage from the plan alone (the communicators counted without the model's
    tied parameters, which only the profile knows)."""
    head = f"M={plan.micro_batches}, micro-batch {plan.micro_batch_size}, schedule {plan.schedule}, policy {plan.policy}"
    if plan.ooo:
        head += ", out-of-order backprop"
    table = Table(title=f"dapple plan ({plan.kind()})", caption=head)
    for column in ("stage", "layers", "#layers", "devices (ranks)", "replicas", "K_i", "recompute", "zero", "NCCL comms"):
        table.add_column(column, justify="right" if column in ("stage", "#layers", "replicas", "K_i", "zero", "NCCL comms") else "left")
    counts = communicators_per_rank(plan)
    memory = list(plan.predicted.memory_bytes) if plan.predicted is not None else []
    if memory:
        table.add_column("predicted memory", justify="right")
    for index, stage in enumerate(plan.stages):
        row = [
            str(index), f"[{stage.start}, {stage.end})", str(stage.end - stage.start), _devices(stage.devices), str(stage.replicas),
            "-" if stage.warmup is None else str(stage.warmup), stage.recompute, str(stage.zero), str(max(counts[rank] for rank in stage.devices)),
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


def _memory_cell(memory: float, budget: float) -> str:
    """Bytes per device against the device's budget, in GiB (MiB for budgets under 1 GiB)."""
    unit, scale = ("GiB", GIB) if budget >= GIB else ("MiB", GIB / 1024)
    return f"{memory / scale:.2f} / {budget / scale:.1f} {unit}"


def plan_summary(plan: Plan) -> str:
    """Predicted phases, simulated latency, bubble and the planner's reason, as lines."""
    lines = []
    p = plan.predicted
    if p is not None:
        lines.append(
            f"predicted latency {p.latency_ms:.1f} ms = warm-up {p.warmup_ms:.1f} + steady {p.steady_ms:.1f} + ending {p.ending_ms:.1f} "
            f"(pivot stage {p.pivot_stage})"
        )
        if p.simulated_latency_ms is not None:
            bubble = f", bubble {100 * p.bubble_fraction:.1f}%" if p.bubble_fraction is not None else ""
            lines.append(f"simulated latency {p.simulated_latency_ms:.1f} ms{bubble}")
    if plan.reason:
        lines.append(f"why: {plan.reason}")
    return "\n".join(lines)
