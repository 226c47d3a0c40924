"""The user's plan arguments and the one function that applies them to a plan.

A run gets its plan from a file, a mapping, a ``Plan`` or the planner (``plan="auto"``),
and the user may still say how it runs: M (``micro_batches``), the schedule (DAPPLE's
early backward or GPipe), the K_i policy (DAPPLE 5.3: P_A or P_B), per-stage
recomputation (gpipe.txt 2.3) and out-of-order backprop (ooo-backprop sec. 3). The
strategy's keyword arguments and the Hydra app's ``strategy`` group carry the same
arguments; both build a :class:`PlanArguments` and call :func:`resolve_plan`, so the two
entry points cannot disagree about what a run executes. The planner reads the same
object (:meth:`PlanArguments.planner_kwargs`) when it makes the base plan.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.options import set_options
from lightning_dapple.plan.plan import SCHEDULES, ZERO_LEVELS, Plan, PlanShape, plan_or_shape_from_dict, read_plan_data
from lightning_dapple.plan.request import AUTO_ZERO
from lightning_dapple.plan.schedule_choice import AUTO_SCHEDULE
from lightning_dapple.strategy.ooo_choice import OooSetting, check_ooo, decide_ooo, with_ooo_choice

__all__ = ["PlanArguments", "given_plan", "resolve_plan", "shape_with_arguments"]


@dataclass(frozen=True)
class PlanArguments:
    """What the user asked of the plan; ``None`` keeps what the plan says.

    ``policy`` "auto" and ``None`` both keep the plan's policy; ``recompute`` "auto" is
    resolved by the planner's memory model (``simulate.memory_fit``) and needs
    ``plan="auto"``; ``ooo`` "auto" lets ``strategy.ooo_choice`` decide. ``schedule``
    "auto" and ``None`` both let the planner choose it by simulation under ``plan="auto"``
    (``plan.schedule_choice``) and keep a given plan's. ``zero`` 1 or 2 shards every
    replicated stage's optimizer state at that level (the planner sizes memory with it);
    "auto" lets the planner choose per stage under ``plan="auto"`` (``plan.zero_choice``) and
    keeps a given plan's; 0 and ``None`` keep the plan's (the planner then shards nothing).
    """

    micro_batches: int | None = None
    schedule: str | None = None
    policy: str | None = None
    recompute: str | Sequence[str] | None = None
    ooo: OooSetting = "auto"
    zero: int | str | None = None

    def __post_init__(self) -> None:
        require(
            self.schedule in (None, AUTO_SCHEDULE, *SCHEDULES), "schedule", f"is {self.schedule!r}", f"use {AUTO_SCHEDULE!r} or one of {list(SCHEDULES)}"
        )
        require(self.policy in (None, "PA", "PB", "auto"), "policy", f"is {self.policy!r}", "use 'PA', 'PB' or 'auto'")
        require(
            self.micro_batches is None or (isinstance(self.micro_batches, int) and not isinstance(self.micro_batches, bool) and self.micro_batches > 0),
            "micro_batches",
            f"is {self.micro_batches!r}",
            "use a positive integer or leave it out",
        )
        require(
            self.recompute is None or isinstance(self.recompute, (str, list, tuple)),
            "recompute",
            f"is {self.recompute!r}",
            "use 'never', 'always', 'except_last', 'auto' or one mode per stage",
        )
        object.__setattr__(self, "ooo", check_ooo(self.ooo))
        require(
            self.zero is None or (self.zero in (AUTO_ZERO, *ZERO_LEVELS) and not isinstance(self.zero, bool)),
            "zero",
            f"is {self.zero!r}",
            f"use {AUTO_ZERO!r} (chosen per stage by the planner) or one of {list(ZERO_LEVELS)}",
        )

    @property
    def fixed_zero(self) -> int | None:
        """The ZeRO level the user set for every replicated stage (1 or 2), or None."""
        return int(self.zero) if self.zero not in (None, AUTO_ZERO, 0) else None  # type: ignore[arg-type]

    @property
    def fixed_schedule(self) -> str | None:
        """The schedule the user named, or None (left to the planner, or to a given plan)."""
        return self.schedule if self.schedule not in (None, AUTO_SCHEDULE) else None

    @property
    def fixed_policy(self) -> str | None:
        """The K_i policy the user fixed ('PA'/'PB'), or None."""
        return self.policy if self.policy in ("PA", "PB") else None

    def planner_kwargs(self) -> dict[str, Any]:
        """The arguments the planner takes from the user (``simulate.plan_and_schedule.make_plan``);
        the schedule is chosen by simulation unless the user named one."""
        kwargs: dict[str, Any] = {"schedule": self.fixed_schedule or AUTO_SCHEDULE}
        if self.micro_batches is not None:
            kwargs["micro_batches"] = self.micro_batches
        if self.fixed_policy is not None:
            kwargs["policy"] = self.fixed_policy
        if self.zero not in (None, 0):
            kwargs["zero"] = self.zero
        if isinstance(self.recompute, str) and self.recompute not in ("auto", "never"):
            kwargs["recompute"] = self.recompute  # every candidate priced recomputing, as it will run
        return kwargs


def given_plan(spec: Any, arguments: PlanArguments) -> Plan | PlanShape | None:
    """The plan or shape ``spec`` names (a ``Plan``, a ``PlanShape``, a dict or a JSON file;
    None for ``"auto"``), with the user's M, schedule and policy applied to a dict or a
    file's data before it is checked: a plan whose stages repeat their devices is valid only
    under a chunked schedule, which the argument may be what names. A K_i written for
    other values is dropped with them (``resolve_plan`` refills it)."""
    if isinstance(spec, (Plan, PlanShape)) or spec is None or (isinstance(spec, str) and spec == "auto"):
        return spec if isinstance(spec, (Plan, PlanShape)) else None
    data = dict(spec) if isinstance(spec, dict) else read_plan_data(Path(spec))
    source = "plan" if isinstance(spec, dict) else f"plan {Path(spec).name}"
    if not isinstance(data, dict):
        return plan_or_shape_from_dict(data, source)
    fixed = {"micro_batches": arguments.micro_batches, "schedule": arguments.fixed_schedule, "policy": arguments.fixed_policy}
    changed = {name: value for name, value in fixed.items() if value is not None and data.get(name) != value}
    if changed:
        data.update(changed)
        if isinstance(data.get("stages"), list):
            data["stages"] = [{k: v for k, v in stage.items() if k != "warmup"} if isinstance(stage, dict) else stage for stage in data["stages"]]
    return plan_or_shape_from_dict(data, source)


def resolve_plan(base: Plan, arguments: PlanArguments) -> Plan:
    """``base`` with the user's ``arguments`` applied: the plan the run executes.

    Changing M, the schedule or the policy drops the plan's K_i (they were chosen for the
    old values) so that ``Plan.with_warmups`` refills them by the policy (DAPPLE 5.3); an
    argument the plan already has (the planner was given it) keeps them, memory caps
    included.
    Fixed recomputation modes are set per stage; ``recompute="auto"`` was already resolved
    when the planner made ``base``. The out-of-order choice is recorded with its reason,
    unless ``ooo="auto"`` and the planner already decided it with a profile.
    """
    plan = base
    given = {key: value for key, value in arguments.planner_kwargs().items() if key not in ("zero", "recompute")}
    given["schedule"] = arguments.fixed_schedule or plan.schedule
    overrides = {name: value for name, value in given.items() if getattr(plan, name) != value}
    if overrides:
        stages = tuple(replace(stage, warmup=None) for stage in plan.stages)
        plan = replace(plan, stages=stages, **overrides)
    if arguments.recompute is not None and arguments.recompute != "auto":
        plan = set_options(plan, recompute=arguments.recompute)
    if arguments.fixed_zero is not None:
        plan = set_options(plan, zero=arguments.fixed_zero)
    if arguments.ooo != "auto" or "ooo_choice" not in plan.extra:
        plan = with_ooo_choice(plan, *decide_ooo(arguments.ooo, plan))
    return plan


def shape_with_arguments(shape: PlanShape, arguments: PlanArguments) -> PlanShape:
    """``shape`` with the user's M, schedule, policy and fixed recomputation modes, which
    the planner then cuts the layers for (the arguments win over the shape's own)."""
    recompute = arguments.recompute
    if isinstance(recompute, str):
        require(recompute != "auto", "recompute", "is 'auto' with a plan shape", "name a mode (never/always/except_last), or use plan='auto'")
        recompute = [recompute] * len(shape.devices)
    return replace(
        shape,
        micro_batches=arguments.micro_batches if arguments.micro_batches is not None else shape.micro_batches,
        schedule=arguments.fixed_schedule or shape.schedule,
        policy=arguments.fixed_policy or shape.policy,
        recompute=tuple(recompute) if recompute is not None else shape.recompute,
    ).validate()
