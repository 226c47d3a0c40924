"""What every planner shares: the micro-batch candidates, the memory filter and the scoring of
a finished plan with the one cost model (``costs.py``) and, when available, the simulator.

Keeping this in one place is what makes the planners comparable: DAPPLE's DP, PipeDream's
recurrence, the DP and straight baselines and the exhaustive enumerator all price a plan with
``dapple_latency(stage_costs(...))`` (DAPPLE 4.1, formulas 1-2), filter it with
``stage_memory_bytes`` at K_i from ``warmup_counts`` (DAPPLE 5.3; M under GPipe), and accept
it only if every replica's slice is at least ``min_slice`` samples.

Why a slice floor: the profile's times scale linearly with the samples a device runs
(``ModelProfile.scale``), so without a floor the latency model would always prefer tiny
micro-batches (bubbles shrink, per-sample cost stays constant) -- something no real device
does, because a device is only efficient at a reasonable batch (DAPPLE 5.2.2: "we use ... large
enough micro-batch size setting to ensure device efficiency"). The default floor is the
profile's own micro-batch size: the smallest batch for which the measured times are known to
hold. A slice below one sample is never valid.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.communicators import communicator_memory
from lightning_dapple.plan.costs import (
    StageCost,
    dapple_latency,
    stage_costs,
    stage_memory_bytes,
)
from lightning_dapple.plan.plan import SCHEDULES, Plan, Prediction, StagePlan
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = [
    "Scored",
    "candidate_micro_batches",
    "check_inputs",
    "default_min_slice",
    "in_flight_limits",
    "memory_per_stage",
    "score_stages",
    "subcluster",
    "finish_plan",
]


def default_min_slice(profile: ModelProfile, min_slice: int | None) -> int:
    """The slice floor: ``min_slice`` if given, else the profile's micro-batch size."""
    if min_slice is None:
        return profile.micro_batch_size
    require(
        isinstance(min_slice, int) and not isinstance(min_slice, bool) and min_slice >= 1,
        "min_slice",
        f"must be a positive integer, got {min_slice!r}",
        "give the smallest number of samples a device should run per micro-batch",
    )
    return min_slice


def check_inputs(schedule: str, policy: str, global_batch_size: int) -> None:
    require(schedule in SCHEDULES, "schedule", f"is {schedule!r}", f"use one of {list(SCHEDULES)}")
    require(policy in ("PA", "PB"), "policy", f"is {policy!r}", "use 'PA', 'PB' or 'auto' (DAPPLE 5.3)")
    require(
        isinstance(global_batch_size, int) and not isinstance(global_batch_size, bool) and global_batch_size > 0,
        "global_batch_size",
        f"must be a positive integer, got {global_batch_size!r}",
        "pass the number of samples of one optimizer step, e.g. --global-batch-size 64",
    )


def subcluster(cluster: Cluster, num_devices: int | None) -> Cluster:
    """The first ``num_devices`` devices of ``cluster`` as a cluster of their own."""
    if num_devices is None or num_devices == cluster.num_devices:
        return cluster
    require(
        isinstance(num_devices, int) and 1 <= num_devices <= cluster.num_devices,
        "num_devices",
        f"must be between 1 and {cluster.num_devices}, got {num_devices!r}",
        "plan for at most the devices the cluster has",
    )
    per = cluster.devices_per_machine
    if num_devices % per == 0:
        return replace(cluster, machines=num_devices // per)
    require(
        num_devices < per,
        "num_devices",
        f"{num_devices} is neither a multiple of {per} devices per machine nor part of one machine",
        f"use a multiple of {per} or fewer than {per} devices",
    )
    return replace(cluster, machines=1, devices_per_machine=num_devices)


def candidate_micro_batches(
    global_batch_size: int,
    min_slice: int,
    micro_batches: int | None = None,
) -> tuple[list[int], int]:
    """(M candidates, effective slice floor).

    Chosen by the planner: every divisor M of the global batch whose micro-batch is at least
    ``min_slice`` samples (so an unreplicated stage is valid). Given by the user: exactly that
    M, and the floor drops to the micro-batch size when it is smaller (the user asked for it).
    """
    if micro_batches is not None:
        require(
            isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches > 0,
            "micro_batches",
            f"must be a positive integer, got {micro_batches!r}",
            "pass M >= 1 or leave it out to let the planner choose",
        )
        require(
            global_batch_size % micro_batches == 0,
            "micro_batches",
            f"global batch {global_batch_size} cannot be split into {micro_batches} equal micro-batches",
            f"use a divisor of {global_batch_size} (e.g. {_divisors_near(global_batch_size, micro_batches)})",
        )
        return [micro_batches], min(min_slice, global_batch_size // micro_batches)
    candidates = [m for m in range(1, global_batch_size + 1) if global_batch_size % m == 0 and global_batch_size // m >= min_slice]
    require(
        bool(candidates),
        "global_batch_size",
        f"{global_batch_size} samples cannot be split into micro-batches of at least {min_slice} samples (the slice floor)",
        f"use a global batch of at least {min_slice}, or a profile taken at a smaller batch (--profile-batch-size)",
    )
    return candidates, min_slice


def _divisors_near(n: int, wanted: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    best = sorted(divisors, key=lambda d: (abs(d - wanted), d))[:3]
    return ", ".join(str(d) for d in sorted(best))


def memory_per_stage(
    costs: Sequence[StageCost],
    micro_batches: int,
    cluster: Cluster,
    policy: str = "PA",
    schedule: str = "dapple",
    warmups: Sequence[int] | None = None,
) -> list[float]:
    """Peak bytes per device of every stage with K_i from DAPPLE 5.3 (M under GPipe), or
    the ``warmups`` given."""
    counts = list(warmups) if warmups is not None else warmup_counts(len(costs), micro_batches, policy, schedule=schedule)
    return [stage_memory_bytes(cost, count, cluster) for cost, count in zip(costs, counts)]


def in_flight_limits(costs: Sequence[StageCost], micro_batches: int, cluster: Cluster) -> list[int]:
    """The most micro-batches each stage can hold at once in device memory: DAPPLE 5.3's D
    (0 where not even one fits; M where the stage stashes nothing)."""
    limits = []
    for cost in costs:
        room = cluster.device_memory_bytes - stage_memory_bytes(cost, 0, cluster)
        if room < 0:
            limits.append(0)
        elif cost.stash_bytes <= 0:
            limits.append(micro_batches)
        else:
            count = min(micro_batches, int(room // cost.stash_bytes))
            while count > 0 and stage_memory_bytes(cost, count, cluster) > cluster.device_memory_bytes:
                count -= 1  # floor() of a quotient can be one off
            limits.append(count)
    return limits


@dataclass(frozen=True)
class Scored:
    """A plan's stages priced by the shared cost model."""

    stages: tuple[StagePlan, ...]
    micro_batches: int
    prediction: Prediction
    costs: tuple[StageCost, ...]

    @property
    def latency_ms(self) -> float:
        return self.prediction.latency_ms

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.prediction.memory_bytes)

    def fits(self, cluster: Cluster) -> bool:
        return self.peak_memory_bytes <= cluster.device_memory_bytes

    def kind(self) -> str:
        return Plan(global_batch_size=self.micro_batches, micro_batches=self.micro_batches, stages=self.stages).kind()


def score_stages(
    profile: ModelProfile,
    cluster: Cluster,
    stages: Sequence[StagePlan],
    global_batch_size: int,
    micro_batches: int,
    policy: str = "PA",
    schedule: str = "dapple",
    communicator_bytes: float = 0.0,
) -> Scored:
    """Formula 1-2 latency and per-device memory of ``stages`` (the one scoring function);
    stages that carry their K_i (``warmup``) are sized with them. ``communicator_bytes`` is
    the device memory each NCCL communicator of the plan takes (``plan.communicators``: 0
    where the run does not use NCCL), added to each stage's memory."""
    stages = tuple(stages)
    costs = stage_costs(profile, cluster, stages, global_batch_size // micro_batches)
    given = [stage.warmup for stage in stages]
    warmups = given if all(count is not None for count in given) else None
    memory = memory_per_stage(costs, micro_batches, cluster, policy, schedule, warmups)  # type: ignore[arg-type]
    if communicator_bytes > 0:
        bare = Plan(global_batch_size, micro_batches, stages, schedule, policy)
        reserve = communicator_memory(bare, communicator_bytes, profile.tied, cluster.num_devices)
        memory = [each + extra for each, extra in zip(memory, reserve)]
    return Scored(stages, micro_batches, dapple_latency(costs, micro_batches, memory), tuple(costs))


def finish_plan(
    scored: Scored,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    policy: str,
    schedule: str,
    planner: str,
    reason: str = "",
    simulation: Any = None,
    extra: dict[str, Any] | None = None,
) -> Plan:
    """Turn a scored candidate into the plan JSON the runtime executes (K_i filled in)."""
    prediction = scored.prediction
    if simulation is not None:
        prediction = replace(
            prediction,
            simulated_latency_ms=float(simulation.latency_ms),
            bubble_fraction=float(simulation.bubble_fraction),
        )
    plan = Plan(
        global_batch_size=global_batch_size,
        micro_batches=scored.micro_batches,
        stages=scored.stages,
        schedule=schedule,
        policy=policy,
        predicted=prediction,
        planner=planner,
        reason=reason,
        extra=dict(extra or {}),
    ).with_warmups(policy)
    plan.validate(num_layers=profile.num_layers, world_size=cluster.num_devices)
    return plan


def format_gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def raise_no_memory(
    profile: ModelProfile,
    cluster: Cluster,
    smallest_bytes: float,
    what: str,
    zero_tried: bool = False,
) -> None:
    """One line: the smallest plan's memory against the budget, and what would make room
    (sharding the optimizer state only where the search did not try it already)."""
    shard = "" if zero_tried else ", or let replicated stages shard their optimizer state (zero='auto', DappleStrategy(zero='auto'))"
    raise DappleConfigError(
        "cluster.device_memory_gib",
        f"no plan fits in {cluster.device_memory_gib:g} GiB per device: the smallest plan ({what}) needs "
        f"{smallest_bytes / GIB:.2f} GiB per device for {profile.name}",
        "use more devices (--cluster), smaller micro-batches (more --micro-batches or a smaller global batch), "
        f"devices with more memory (--memory-gib){shard}; the planner sizes every stash without recomputation, so an "
        "explicit plan whose stages recompute (recompute='always') may still fit",
    )
