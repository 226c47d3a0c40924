"""Plan-level operations that need both the schedule builders and the simulator.

A :class:`~lightning_dapple.plan.plan.Plan` says what runs where; this module turns it into
what runs when -- the action lists the executor interprets (``schedule_for_plan``) -- and
prices those lists: the simulated step (``simulate_plan``), the memory of each stage under
the schedule's stash walk (``stage_memory``, DAPPLE 5.3), and the planners with their
simulated re-ranking (``make_plan``: DAPPLE 4 searches with the closed formula, then the
shortlist is ordered by simulating the exact schedules, which see the pivot stage's
internal bubbles that formula 1-2 does not).

It sits above ``plan``, ``schedule`` and ``simulate.engine``; the executor, the strategy and
the command lines take plans' schedules and simulations from here.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.buckets import BUCKET_BYTES
from lightning_dapple.plan.costs import (
    StageCost,
    stage_costs,
    stage_memory_from_stash,
    synced_layer_bytes,
)
from lightning_dapple.plan.dapple_planner import plan_dapple
from lightning_dapple.plan.options import with_weight_split
from lightning_dapple.plan.pipedream_planner import plan_pipedream
from lightning_dapple.plan.plan import CHUNKED_SCHEDULES, POLICIES, Plan
from lightning_dapple.plan.schedule_choice import (
    AUTO_SCHEDULE,
    RUNNABLE_SCHEDULES,
    Finisher,
    choose_schedule,
)
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.plan.warmup import chunked_warmup_counts
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.schedule.actions import Schedule, group_stash_walk, stash_walk
from lightning_dapple.schedule.ooo import build_ooo_schedule
from lightning_dapple.schedule.registry import build_named
from lightning_dapple.simulate.cores import bound_by_shared_cores
from lightning_dapple.simulate.engine import (
    ScheduleDeadlock,
    SimulationResult,
    simulate,
)

__all__ = ["PLANNERS", "check_plan_fits", "make_plan", "price_plan", "schedule_for_plan", "simulate_plan", "stage_memory"]

PLANNERS = ("dapple", "pipedream")


def schedule_for_plan(plan: Plan, profile: ModelProfile | None = None, bucket_bytes: int | None = None) -> Schedule:
    """The schedule a plan asks for, with its K_i filled by its policy when missing.

    Plans with several stages per device group get interleaved 1F1B
    (``schedule.interleaved``) or ZB-V (``schedule.zbv``), with ``placement`` and each
    group's merged ``orders`` filled. ``plan.ooo`` adds deferred W actions (``schedule.ooo.build_ooo_schedule``: caps from
    ``plan.ooo_in_flight`` when the planner set them, k from ``plan.first_k``);
    each stage's ``recompute`` mode is carried along either way. With the model's
    ``profile`` a replicated stage's ALLREDUCE actions are the gradient buckets of
    ``plan.buckets.bucket_layers`` (of ``bucket_bytes``, default ``BUCKET_BYTES``), the
    ones the executor launches; without it they are one marker per stage. The compute
    actions do not depend on either, so the executor (which ignores ALLREDUCE markers and
    buckets by its parameters' real sizes) runs the same F, B and W as the simulator.
    """
    plan = plan.with_warmups()
    modes = tuple(stage.recompute for stage in plan.stages)
    if plan.schedule in CHUNKED_SCHEDULES:
        return _chunked_schedule(plan, modes if any(mode != "never" for mode in modes) else ())
    if plan.ooo:
        sizes = synced_layer_bytes(profile, plan.stages) if profile is not None else None
        return build_ooo_schedule(
            plan.schedule,
            plan.num_stages,
            plan.micro_batches,
            plan.warmups,
            caps=plan.ooo_in_flight,
            layer_counts=[stage.end - stage.start for stage in plan.stages],
            replicated=[stage.replicas > 1 for stage in plan.stages],
            first_k=plan.first_k,
            recompute=modes,
            param_bytes=sizes,
            bucket_bytes=BUCKET_BYTES if bucket_bytes is None else bucket_bytes,
        )
    return build_named(plan.schedule, num_groups=plan.num_stages, micro_batches=plan.micro_batches, warmups=plan.warmups, recompute=modes)


def _chunked_schedule(plan: Plan, modes: tuple[str, ...]) -> Schedule:
    """Interleaved 1F1B or ZB-V for a plan with several stages per device group (K per
    group: the K of the group's first stage; ``Plan.validate`` makes them equal)."""
    plan.validate()
    placement = plan.placement
    per_group = [plan.warmups[placement.index(group)] for group in range(len(plan.device_groups))]
    built = build_named(plan.schedule, num_groups=len(per_group), chunks=plan.chunks, micro_batches=plan.micro_batches, warmups=per_group, recompute=modes)
    policies = [chunked_warmup_counts(len(per_group), plan.chunks, plan.micro_batches, policy, plan.schedule) for policy in POLICIES]
    if per_group not in policies:
        _require_completes(built, per_group)
    return built


def _require_completes(schedule: Schedule, per_group: list[int]) -> None:
    """Refuse hand-given K under which a group would wait for work queued behind itself.

    Whether an order can complete does not depend on the actions' durations, so a dry run
    with unit costs decides it before any rank starts (the policies' K always complete).
    """
    unit = StageCost(
        forward_ms=1.0, backward_ms=2.0, backward_input_ms=1.0, backward_weight_ms=1.0, param_bytes=0.0,
        stash_bytes=0.0, output_bytes=0.0, send_ms=0.0, allreduce_ms=0.0, slice_size=1.0,
    )
    try:
        simulate(schedule, [unit] * schedule.num_stages)
    except ScheduleDeadlock as error:
        raise DappleConfigError(
            "plan.stages[].warmup",
            f"K per device group {per_group} cannot run the {schedule.name!r} schedule ({error})",
            "leave warmup out to use the policy's K, or give each group at least its P_A count "
            f"{chunked_warmup_counts(len(per_group), schedule.num_stages // len(per_group), schedule.micro_batches, 'PA', schedule.name)}",
        ) from error


def _priced(plan: Plan, profile: ModelProfile) -> ModelProfile:
    """The profile a plan's schedule is priced with: schedules that split backwards into I
    and W (``plan.ooo``, ZB-V) need each layer's B/W split, measured or estimated
    (``plan.options.with_weight_split``)."""
    return with_weight_split(profile) if plan.ooo or schedule_spec(plan.schedule).splits_backward else profile


def check_plan_fits(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Plan:
    """Validate ``plan`` for this model and cluster: layers cover the profile exactly, the
    ranks are 0..W-1 and W does not exceed the cluster's device count."""
    plan.validate(num_layers=profile.num_layers, world_size=plan.world_size)
    require(
        plan.world_size <= cluster.num_devices,
        "plan.stages[].devices",
        f"use ranks up to {plan.world_size - 1} but cluster {cluster.name!r} has only {cluster.num_devices} devices",
        f"use at most {cluster.num_devices} devices or a larger cluster",
    )
    return plan


def simulate_plan(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    schedule: str | None = None,
) -> SimulationResult:
    """Simulate one step of ``plan`` for ``profile`` on ``cluster``.

    ``schedule`` ('dapple' or 'gpipe') overrides ``plan.schedule``; when it differs, the
    plan's K_i (chosen for the other schedule) are dropped and refilled by the plan's policy.
    K_i come from ``plan.with_warmups()`` (DAPPLE 5.3). Costs are those of ``stage_costs``,
    the ones the planner's formula uses, so the two can be compared. The action lists are
    those of ``schedule_for_plan``, the ones the executor runs (with the profile's gradient
    buckets as ALLREDUCE actions): with ``plan.ooo`` the out-of-order schedule, and for
    ``zbv`` the V schedule, whose W work is priced from the profile's measured B/W split
    or, for profiles without one, the estimate of ``plan.options.with_weight_split``;
    each stage's ``recompute`` mode adds the recomputed forwards. A plan with several
    stages per device group is simulated with one clock per group (``simulate.engine``).
    On CPU processes sharing fewer cores than they are (``cluster.shared_cores``) the step
    is no shorter than the machine's compute on those cores (``simulate.cores``).
    """
    check_plan_fits(plan, profile, cluster)
    if schedule is not None and schedule != plan.schedule:
        plan = replace(plan, schedule=schedule, stages=tuple(replace(stage, warmup=None) for stage in plan.stages))
        plan.validate()
    plan = plan.with_warmups()
    built = schedule_for_plan(plan, profile)
    costs = stage_costs(_priced(plan, profile), cluster, plan.stages, plan.micro_batch_size)
    return bound_by_shared_cores(simulate(built, costs, [stage.devices for stage in plan.stages]), cluster)


def stage_memory(plan: Plan, profile: ModelProfile, cluster: Cluster) -> tuple[list[float], list[float], Any, list[StageCost]]:
    """(memory bytes per stage, peak stashed bytes per stage, schedule, costs) of ``plan``
    as the executor would run it.

    What is counted (DAPPLE 5.3): per device, weights, gradients and optimizer state of
    the parameters it holds, plus the peak of the stash walk (``schedule.actions``:
    activations of the micro-batches in flight, stage inputs of recomputed ones, kept
    output gradients while a W is pending). A stage's entries are those of the devices
    that run it: with several stages per device group (interleaved, V) both entries are
    the group's -- the parameters of all its chunks, and the peak of one walk over the
    group's merged order in which each chunk keeps its own ``StageCost`` bytes -- repeated
    for each of the group's stages, so the largest entry is still the largest device's.
    """
    plan = plan.with_warmups()
    schedule = schedule_for_plan(plan, profile)
    costs = stage_costs(_priced(plan, profile), cluster, plan.stages, plan.micro_batch_size)
    if schedule.orders:
        memory, stashes = _group_memory(schedule, costs, cluster)
        return memory, stashes, schedule, costs
    stashes, memory = [], []
    for index, cost in enumerate(costs):
        peak, _ = stash_walk(schedule.compute(index), schedule.recomputed(index), cost.stash_bytes, cost.input_bytes, cost.wgrad_bytes)
        stashes.append(peak)
        memory.append(stage_memory_from_stash(cost, peak, cluster))
    return memory, stashes, schedule, costs


def price_plan(plan: Plan, profile: ModelProfile, cluster: Cluster) -> tuple[SimulationResult, list[float], list[StageCost]]:
    """(simulated step, memory bytes per stage, stage costs) of ``plan`` as the executor
    would run it, after ``check_plan_fits``: how ``schedule="auto"`` prices a candidate."""
    check_plan_fits(plan, profile, cluster)
    memory, _, _, costs = stage_memory(plan, profile, cluster)
    return simulate_plan(plan, profile, cluster), memory, costs


def _group_memory(schedule: Schedule, costs: list[StageCost], cluster: Cluster) -> tuple[list[float], list[float]]:
    """Per stage, the memory and peak stash of the device group running it (``stage_memory``)."""
    stages = range(schedule.num_stages)
    recomputed = {s: schedule.recomputed(s) for s in stages}
    stash = {s: costs[s].stash_bytes for s in stages}
    inputs = {s: costs[s].input_bytes for s in stages}
    wgrads = {s: costs[s].wgrad_bytes for s in stages}
    group_peak, group_memory = [], []
    for group in range(schedule.num_groups):
        compute = [action for action in schedule.group_actions(group) if action.kind.is_compute]
        peak, _ = group_stash_walk(compute, recomputed, stash, inputs, wgrads)
        held = [costs[s] for s in stages if schedule.group_of(s) == group]
        weights = sum(stage_memory_from_stash(cost, 0.0, cluster) for cost in held)
        group_peak.append(peak)
        group_memory.append(weights + peak)
    return [group_memory[schedule.group_of(s)] for s in stages], [group_peak[schedule.group_of(s)] for s in stages]


def make_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    planner: str = "dapple",
    simulate: bool = True,
    schedule: str = "dapple",
    schedules: Sequence[str] = RUNNABLE_SCHEDULES,
    finish: Finisher | None = None,
    **kwargs: Any,
) -> Plan:
    """Plan ``profile`` for ``cluster`` and a global batch with ``planner``: ``dapple`` is
    DAPPLE's planner (section 4), ``pipedream`` PipeDream's partitioner (3.1), the baseline,
    priced and scheduled the same way so the two can be compared. With ``simulate`` the
    candidates are re-ranked (DAPPLE) and the result annotated by ``simulate_plan``.
    kwargs go to the planner (micro_batches, policy, num_devices, min_slice, ...).

    ``schedule`` "dapple" or "gpipe" is the planner's schedule. "auto" plans for DAPPLE's
    schedule and then runs the planned devices and M under the fastest of ``schedules``
    that fits (``plan.schedule_choice``); a chunked schedule ("interleaved", "zbv") does the
    same with that schedule alone, on DAPPLE's fastest plan of more than one device group (DP
    has no pipeline to chunk; PipeDream's baseline keeps its own plan, and a chunked schedule
    fails on it where that plan is DP). ``finish`` is applied to every candidate before it is
    priced (the run's out-of-order and recomputation choices) and so to the plan returned.
    """
    require(planner in PLANNERS, "planner", f"is {planner!r}", f"use one of {list(PLANNERS)}")
    pricer = simulate_plan if simulate else None
    base_schedule = "dapple" if schedule == AUTO_SCHEDULE or schedule in CHUNKED_SCHEDULES else schedule
    if planner == "pipedream":
        plan = plan_pipedream(profile, cluster, global_batch_size, simulate=pricer, schedule=base_schedule, **kwargs)
    else:  # a chunked schedule needs a pipeline to chunk: the fastest of them, not DP
        plan = plan_dapple(profile, cluster, global_batch_size, simulate=pricer, schedule=base_schedule, pipeline_only=schedule in CHUNKED_SCHEDULES, **kwargs)
    if base_schedule == schedule:
        return finish(plan) if finish is not None else plan
    require(simulate, "schedule", f"is {schedule!r}, which chooses by simulation, but simulate is off", "pass simulate=True or name 'dapple' or 'gpipe'")
    candidates = tuple(schedules) if schedule == AUTO_SCHEDULE else (schedule,)
    return choose_schedule(plan, profile, cluster, price_plan, candidates, finish)
