"""A planning request, built and checked once: what to plan, for which devices, with which
micro-batch candidates and options (DAPPLE 4: the planner's inputs).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import require
from lightning_dapple.plan.evaluate import (
    Scored,
    candidate_micro_batches,
    check_inputs,
    default_min_slice,
    score_stages,
    subcluster,
)
from lightning_dapple.plan.plan import RECOMPUTE_MODES, ZERO_LEVELS, Plan, StagePlan
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["AUTO_ZERO", "AUTO_ZERO_LEVELS", "PlanRequest", "StepPricer", "zero_levels"]

AUTO_ZERO = "auto"
# The levels ``zero="auto"`` chooses among: no sharding and ZeRO-1. ZeRO-2 holds no less at
# a step's peak (``costs.weight_state_factor``: the gradients are whole until the last
# micro-batch's buckets are reduced) and differs only in how its gradients travel, so it is
# planned for when asked for by number (``zero=2``).
AUTO_ZERO_LEVELS = (0, 1)

# Prices one step of a plan exactly (the simulator's ``simulate_plan``): given to the
# planners by the layer above them, which owns the schedules and the simulator.
StepPricer = Callable[[Plan, ModelProfile, Cluster], Any]


@dataclass(frozen=True)
class PlanRequest:
    """Profile, device set (already narrowed to ``num_devices``), global batch, the M
    candidates and the slice floor they respect (``floor``; ``min_slice`` is the setting
    as given), schedule, policy and search options.

    ``policy`` is the K_i policy the search sizes memory with (DAPPLE 5.3); with
    ``auto_policy`` (asked for as policy "auto") it is P_A, the one that holds fewer
    micro-batches, and the simulated re-ranking also tries P_B (``policy_choice``).

    ``zero_levels`` are the ZeRO levels a replicated stage may run at (``costs.py``): the
    search runs once per level, and with more than one level ``zero_choice`` sets each
    stage's own (``zero`` "auto" asks for ``AUTO_ZERO_LEVELS``, an integer for that level
    alone; default 0, every replica keeps the whole optimizer state).
    """

    profile: ModelProfile
    cluster: Cluster
    global_batch_size: int
    micro_batches: tuple[int, ...]
    floor: int
    min_slice: int | None = None
    schedule: str = "dapple"
    policy: str = "PA"
    fixed_micro_batches: int | None = None
    rerank: int = 4
    keep_per_state: int | None = None
    beam: int | None | str = "auto"
    simulate: StepPricer | None = None
    auto_policy: bool = False
    zero_levels: tuple[int, ...] = (0,)
    communicator_bytes: float = 0.0
    recompute: str = "never"
    # a schedule that chunks a pipeline was named: a plan of one device group cannot run it
    pipeline_only: bool = False

    def score(self, stages: Sequence[StagePlan], micro_batches: int, policy: str | None = None) -> Scored:
        """``score_stages`` of ``stages`` for this request (its schedule, its policy unless
        ``policy`` is given, its communicators' memory), every stage recomputing as the
        request's fixed ``recompute`` mode says (gpipe.txt 2.3), so that each candidate's
        latency, memory and simulated step are those of the plan as it will run."""
        if self.recompute != "never":
            stages = [replace(stage, recompute=self.recompute) for stage in stages]
        return score_stages(
            self.profile, self.cluster, stages, self.global_batch_size, micro_batches, policy or self.policy, self.schedule, self.communicator_bytes
        )

    @property
    def zero_auto(self) -> bool:
        """Whether the planner chooses each replicated stage's ZeRO level."""
        return len(self.zero_levels) > 1

    @cached_property
    def tables(self) -> RangeTables:
        """The profile's range sums, built once for every search and baseline of the request."""
        return RangeTables(self.profile)

    @classmethod
    def build(
        cls,
        profile: ModelProfile,
        cluster: Cluster,
        global_batch_size: int,
        micro_batches: int | None = None,
        schedule: str = "dapple",
        policy: str = "PA",
        num_devices: int | None = None,
        min_slice: int | None = None,
        rerank: int = 4,
        keep_per_state: int | None = None,
        beam: int | None | str = "auto",
        simulate: StepPricer | None = None,
        zero: int | str = 0,
        communicator_bytes: float = 0.0,
        recompute: str = "never",
        pipeline_only: bool = False,
    ) -> "PlanRequest":
        """Check the inputs (``DappleConfigError`` on bad ones) and resolve the defaults."""
        require(
            recompute in RECOMPUTE_MODES,
            "recompute",
            f"is {recompute!r}, which the planner cannot price for every stage",
            f"use one of {list(RECOMPUTE_MODES)} (recompute='auto' is chosen after planning, by the memory fit)",
        )
        auto_policy = policy == "auto"
        if auto_policy:
            policy = "PA"
        check_inputs(schedule, policy, global_batch_size)
        cluster = subcluster(cluster, num_devices)
        floor = default_min_slice(profile, min_slice)
        candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
        return cls(
            profile, cluster, global_batch_size, tuple(candidates), floor, min_slice, schedule, policy, micro_batches, rerank, keep_per_state, beam, simulate,
            auto_policy, zero_levels(zero), float(communicator_bytes), recompute, pipeline_only,
        )


def zero_levels(zero: int | str) -> tuple[int, ...]:
    """The ZeRO levels the planner may give replicated stages for the setting ``zero``."""
    if zero == AUTO_ZERO:
        return AUTO_ZERO_LEVELS
    require(
        zero in ZERO_LEVELS and not isinstance(zero, bool),
        "zero",
        f"is {zero!r}",
        f"use {AUTO_ZERO!r} (the planner chooses per stage) or one of {list(ZERO_LEVELS)}",
    )
    return (int(zero),)
