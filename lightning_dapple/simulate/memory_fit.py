"""Per-stage recomputation, out-of-order deferral caps and Algorithm 2's k for a plan.

A planner (DAPPLE 4) decides the stages, replication, M and K_i; this module then fills in
what the memory/time trade-offs of this issue add, by pricing the *exact action lists* the
executor will run (``schedule_for_plan``) with the shared cost model:

* memory per device = weights + gradients + optimizer state (``stage_memory_bytes``'s
  first term, ZeRO's share where a stage shards) + the peak of the schedule's stash walk
  (``schedule.actions.stash_walk``: full stash for held micro-batches, only the stage input
  for recomputed ones, stash plus the layer-output gradients for micro-batches whose W is
  deferred) + the NCCL communicators' reserve where the planner priced one
  (``extra["communicators"]``, ``plan.communicators``);
* ``recompute="auto"``: every stage starts at ``never`` with the default deferral cap; a
  stage over the device memory first holds fewer deferred micro-batches (cap down to its
  K_i, then 0: no deferral, then -1: no B/W split on that stage), then recomputes
  ``except_last``, then
  ``always`` (gpipe.txt 2.3 re-materialization; DAPPLE 6.5 Table 5: recomputation trades
  ~20% throughput for memory), each again from the largest cap. The first setting that
  fits is the cheapest one: smaller caps only cost bubbles, recomputation costs a stage
  forward per recomputed micro-batch, which the latency model adds to that stage's
  backward (``StageCost.recompute_ms``). When nothing fits, each stage keeps the setting
  that needed least memory, and the reason says so;
* ``first_k`` (ooo-backprop Algorithm 2) is left as the plan says (none: conventional
  order). The ending phase's gradient buckets are launched in ``bucket_layers`` order, the
  executor's (``schedule.ooo``), and in that order k = 0 finishes the layers of every
  bucket earliest, so no other k can shorten the step and none is searched for.

The result records each stage's choice in ``stages[i].recompute``, the caps in
``ooo_in_flight`` and the explanation in ``extra["memory"]`` and ``reason``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import require
from lightning_dapple.plan.communicators import communicator_memory
from lightning_dapple.plan.costs import dapple_latency
from lightning_dapple.plan.plan import RECOMPUTE_MODES, Plan
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.schedule.ooo import default_caps
from lightning_dapple.simulate.cores import bound_by_shared_cores
from lightning_dapple.simulate.engine import simulate
from lightning_dapple.simulate.plan_and_schedule import stage_memory

__all__ = ["apply_ooo_recompute"]

_LADDER = ("never", "except_last", "always")
GIB = 1024.0**3


def _with(plan: Plan, modes: Sequence[str], caps: Sequence[int] | None) -> Plan:
    stages = tuple(replace(stage, recompute=mode) for stage, mode in zip(plan.stages, modes))
    in_flight = tuple(int(c) for c in caps) if caps is not None else None
    return replace(plan, stages=stages, ooo_in_flight=in_flight)


def apply_ooo_recompute(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    *,
    ooo: bool = True,
    recompute: "str | Sequence[str]" = "auto",
    memory_budget_bytes: float | None = None,
) -> Plan:
    """``plan`` with out-of-order backprop on or off, each stage's recomputation resolved
    to a concrete mode, the deferral caps chosen, and ``predicted`` re-priced.

    ``recompute``: ``"auto"`` (see the module docstring), one mode for every stage, or a
    list with one entry ("auto" or a mode) per stage. ``memory_budget_bytes`` defaults to
    the cluster's device memory.
    """
    plan = replace(plan, ooo=bool(ooo)).with_warmups()
    num = plan.num_stages
    requested = [recompute] * num if isinstance(recompute, str) else list(recompute)
    require(len(requested) == num, "recompute", f"has {len(requested)} entries for {num} stages", "give one mode per stage or a single mode")
    for value in requested:
        require(value == "auto" or value in RECOMPUTE_MODES, "recompute", f"is {value!r}", f"use 'auto' or one of {list(RECOMPUTE_MODES)}")
    budget = float(memory_budget_bytes) if memory_budget_bytes is not None else cluster.device_memory_bytes
    warmups = list(plan.warmups)
    top = default_caps(plan.schedule, num, plan.micro_batches, warmups)
    per_stage: list[list[tuple[str, int | None]]] = []
    for index in range(num):
        modes = _LADDER if requested[index] == "auto" else (requested[index],)
        if ooo:
            caps = [*range(top[index], min(warmups[index], plan.micro_batches) - 1, -1), 0, -1]
            per_stage.append([(mode, cap) for mode in modes for cap in caps])
        else:
            per_stage.append([(mode, None) for mode in modes])
    position = [0] * num
    never_memory: list[float] | None = None
    least: list[tuple[float, int]] = [(float("inf"), 0)] * num

    reserve = communicator_memory(plan, float(plan.extra.get("communicators", {}).get("reserve_bytes", 0.0)), profile.tied, cluster.num_devices)

    def build(positions: list[int]) -> tuple[Plan, Any]:
        modes = [per_stage[i][positions[i]][0] for i in range(num)]
        caps = [int(per_stage[i][positions[i]][1] or 0) for i in range(num)] if ooo else None
        candidate = _with(plan, modes, caps)
        memory, stashes, schedule, costs = stage_memory(candidate, profile, cluster)
        return candidate, ([m + extra for m, extra in zip(memory, reserve)], stashes, schedule, costs)

    while True:
        candidate, (memory, stashes, schedule, costs) = build(position)
        if never_memory is None:
            never_memory = memory
        for i in range(num):
            least[i] = min(least[i], (memory[i], position[i]))
        over = [i for i in range(num) if memory[i] > budget]
        movable = [i for i in over if position[i] + 1 < len(per_stage[i])]
        if not movable:
            if over:  # nothing fits: keep, per stage, the setting that needed least memory
                position = [least[i][1] if i in over else position[i] for i in range(num)]
                candidate, (memory, stashes, schedule, costs) = build(position)
            break
        for i in movable:
            position[i] += 1
    plan = candidate
    result = bound_by_shared_cores(simulate(schedule, costs, [stage.devices for stage in plan.stages]), cluster)
    formula = dapple_latency(costs, plan.micro_batches, memory)
    predicted = replace(formula, simulated_latency_ms=result.latency_ms, bubble_fraction=result.bubble_fraction)
    explanation = _explain(plan, memory, never_memory or memory, stashes, budget)
    extra = dict(plan.extra)
    extra["memory"] = explanation
    note = _reason_text(plan, requested, top, memory, never_memory or memory, budget)
    reason = plan.reason + (" " if plan.reason and note else "") + note
    return replace(plan, predicted=predicted, extra=extra, reason=reason)


def _explain(plan: Plan, memory: Sequence[float], never: Sequence[float], stashes: Sequence[float], budget: float) -> dict[str, Any]:
    caps = plan.ooo_in_flight
    stages = []
    for index, stage in enumerate(plan.stages):
        entry: dict[str, Any] = {
            "recompute": stage.recompute,
            "memory_bytes": memory[index],
            "stash_bytes": stashes[index],
            "memory_if_never_bytes": never[index],
            "fits": memory[index] <= budget,
        }
        if caps is not None:
            entry["ooo_in_flight"] = caps[index]
        stages.append(entry)
    return {"budget_bytes": budget, "ooo": plan.ooo, "first_k": plan.first_k, "stages": stages}


def _reason_text(
    plan: Plan, requested: Sequence[str], top: Sequence[int], memory: Sequence[float], never: Sequence[float], budget: float
) -> str:
    """Why stages recompute or defer less than the default, in one sentence per stage."""
    caps = plan.ooo_in_flight if plan.ooo else None
    parts = []
    for index, stage in enumerate(plan.stages):
        words = []
        if requested[index] == "auto" and stage.recompute != "never":
            words.append(f"recomputes ({stage.recompute})")
        if caps is not None and caps[index] != top[index]:
            cap = caps[index]
            words.append(
                "does not split its backward" if cap < 0 else "runs each W right after its B" if cap == 0 else f"defers W for at most {cap} micro-batches"
            )
        if words:
            parts.append(
                f"stage {index} {' and '.join(words)}: with ooo and no recomputation it would need {_size(never[index])} > "
                f"{_size(budget)} budget, now {_size(memory[index])}"
            )
    misfits = [index for index in range(plan.num_stages) if memory[index] > budget]
    if misfits:
        parts.append(f"stages {misfits} exceed the {_size(budget)} budget even with every memory option")
    return "; ".join(parts) + ("." if parts else "")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"
