"""Process groups a plan needs: one per replicated stage (its gradient AllReduce, DAPPLE
5.2.3: replicas of a stage synchronise among themselves only) and one for the whole plan.

``torch.distributed.new_group`` must be called by every rank of the default group, in the
same order, even by ranks outside the new group; ``build_groups`` does exactly that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_dapple.execute.process_groups import subgroup
from lightning_dapple.execute.transfer.wires import waits_on_device
from lightning_dapple.plan.plan import Plan


@dataclass
class PlanGroups:
    replicas: dict[int, Any]
    plan: Any  # group of all ranks of the plan; None means the default (world) group


def build_groups(plan: Plan, backend: str | None = None) -> PlanGroups:
    """The groups of ``plan``, keyed by stage. Stages on the same devices (chunks of one
    device group) share one replica group: their replicas are the same ranks, and every
    replica runs the group's one merged order, so their collectives are issued in the same
    order on each."""
    by_devices: dict[tuple[int, ...], Any] = {}
    replicas: dict[int, Any] = {}
    for index, stage in enumerate(plan.stages):
        if stage.replicas > 1:
            if stage.devices not in by_devices:
                by_devices[stage.devices] = subgroup(sorted(stage.devices), backend=backend)
            replicas[index] = by_devices[stage.devices]
    world = dist.get_world_size()
    plan_group = None
    if plan.world_size != world:
        plan_group = subgroup(sorted({d for s in plan.stages for d in s.devices}), backend=backend)
    return PlanGroups(replicas=replicas, plan=plan_group)


def collective_device(group: Any, compute: torch.device) -> torch.device:
    """Where a small collective over ``group`` (a norm, a flag) takes its tensor: NCCL
    reduces only CUDA tensors, gloo takes them on the CPU. Decided as ``waits_on_device``
    decides how to wait for it (``wires.backend_for``: the backend a mixed group such as
    "cpu:gloo,cuda:nccl" uses for this device), so the two never disagree."""
    try:
        on_device = waits_on_device(compute, group)
    except (RuntimeError, ValueError):
        return torch.device("cpu")
    return compute if on_device else torch.device("cpu")
