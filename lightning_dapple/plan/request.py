"""A planning request, built and checked once: what to plan, for which devices, with which
micro-batch candidates and options (DAPPLE 4: the planner's inputs).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.evaluate import candidate_micro_batches, check_inputs, default_min_slice, subcluster
from lightning_dapple.plan.plan import Plan
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["PlanRequest", "StepPricer"]

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
    ) -> "PlanRequest":
        """Check the inputs (``DappleConfigError`` on bad ones) and resolve the defaults."""
        auto_policy = policy == "auto"
        if auto_policy:
            policy = "PA"
        check_inputs(schedule, policy, global_batch_size)
        cluster = subcluster(cluster, num_devices)
        floor = default_min_slice(profile, min_slice)
        candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
        return cls(
            profile, cluster, global_batch_size, tuple(candidates), floor, min_slice, schedule, policy, micro_batches, rerank, keep_per_state, beam, simulate,
            auto_policy,
        )
