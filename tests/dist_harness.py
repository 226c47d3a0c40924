"""The tests' launcher is the package's (``lightning_dapple.execute.launch``); re-exported here
so test modules import it by one short name."""
from __future__ import annotations

from typing import Any

from lightning_dapple.execute.groups import PlanGroups, build_groups
from lightning_dapple.execute.launch import free_port, run_ranks
from lightning_dapple.plan.plan import Plan

__all__ = ["GroupsPerLayout", "free_port", "run_ranks"]


class GroupsPerLayout:
    """Process groups for many plans in one process group, made once per device layout.

    ``new_group`` is a collective: every rank must ask for every plan's groups in the same
    order, also ranks outside the plan, which is why workers call this before checking
    whether they take part in a plan."""

    def __init__(self) -> None:
        self._made: dict[Any, PlanGroups] = {}

    def __call__(self, plan: Plan) -> PlanGroups:
        layout = tuple(stage.devices for stage in plan.stages)
        if layout not in self._made:
            self._made[layout] = build_groups(plan)
        return self._made[layout]
