"""PipeDream's optimizer (PipeDream 3.1) as a baseline, mapped onto DAPPLE's plan format.

PipeDream picks stages and replication to minimise the slowest stage per minibatch; the
dynamic programme, its cost formulas and its levels live in ``pipedream_optimizer.py``
(over the antichain states of ``pipedream_states.py``, so a branching graph such as
ResNet-50 is cut where PipeDream cuts it). Levels follow the cluster: one flat level of
all devices at the network bandwidth when there is one device per machine, one level of a
machine's devices at the intra-machine bandwidth on a single machine, else the devices of
a machine first (intra bandwidth), then the machines (network bandwidth).

Mapping onto ``Plan``: a cut after a state falls in the profile's linear layer order after
the layers up to that state (``PipeDreamStates.cut_position``). A machine-level stage over
m' machines whose in-machine pipeline has stages of r_1 .. r_k devices becomes k plan
stages replicated r_t x m' ways (the same device offsets on each of its machines); ranks
are handed out in order, machine by machine. PipeDream replicates by round-robin over whole
minibatches; DAPPLE's runtime splits a micro-batch over the replicas (5.2.2), which is what
the shared cost model prices.

Below the top level the optimizer solves every range of states (O(S^3) work); a graph with
more than ``MAX_HIERARCHICAL_STATES`` states (GNMT-16's 1495) is therefore planned on its
linear layer order on hierarchical clusters, as a chain (one state per layer).

PipeDream plans for its minibatch: the batch each worker runs, which is the profile's batch
(``ModelProfile.micro_batch_size``: PipeDream 3.2 profiles one worker at its minibatch).
PipeDream is asynchronous and has no number of micro-batches; a synchronous step of the
global batch runs M = global batch / minibatch of them, so the plan's micro-batch is
PipeDream's minibatch (a global batch that is not a multiple of it is refused). A stage
PipeDream replicates r ways splits each micro-batch over its r replicas here (DAPPLE 5.2.2;
PipeDream hands the replicas whole minibatches in turn, which the linear time model prices
the same), so where r exceeds the minibatch's samples (profiles taken at batch 1) a
micro-batch is the fewest whole minibatches that give each replica a sample. PipeDream's own
memory constraint (off by default) is switched on only when its unconstrained choice does
not fit. The plan is scored with the shared cost model and simulated like DAPPLE's, so the
two are comparable.
"""
from __future__ import annotations

from dataclasses import dataclass

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.evaluate import (
    Scored,
    finish_plan,
    raise_no_memory,
    score_stages,
)
from lightning_dapple.plan.pipedream_optimizer import Level, PipeDreamChoice, optimize
from lightning_dapple.plan.pipedream_states import PipeDreamStates, pipedream_states
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.plan.policy_choice import rescored, simulate_policies
from lightning_dapple.plan.request import PlanRequest, StepPricer
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["plan_pipedream", "pipedream_minibatch", "pipedream_micro_batch_size", "pipedream_partition", "pipedream_levels", "PipeDreamResult"]


@dataclass(frozen=True)
class PipeDreamResult:
    """A PipeDream partition as plan stages, its slowest stage per minibatch (the objective)
    and the data-parallel time under PipeDream's model."""

    stages: tuple[StagePlan, ...]
    slowest_stage_ms: float
    data_parallel_ms: float


MAX_HIERARCHICAL_STATES = 400


def pipedream_levels(cluster: Cluster) -> list[Level]:
    """The optimizer's levels for ``cluster``, lowest first (bandwidths in bytes per ms)."""
    intra = Level(cluster.devices_per_machine, cluster.bytes_per_ms(cluster.intra_bandwidth_gbps))
    inter = Level(cluster.machines, cluster.bytes_per_ms(cluster.inter_bandwidth_gbps))
    if cluster.devices_per_machine == 1:
        return [Level(cluster.machines, inter.bandwidth)]
    if cluster.machines == 1:
        return [intra]
    return [intra, inter]


def pipedream_partition(
    profile: ModelProfile,
    cluster: Cluster,
    micro_batch_size: int,
    max_replicas: int | None = None,
    states: PipeDreamStates | None = None,
    memory: float | None = None,
) -> PipeDreamResult | None:
    """PipeDream's choice for minibatches of ``micro_batch_size`` samples as plan stages,
    or None when a stage would have more than ``max_replicas`` replicas (the slice floor)
    or two cuts fall on the same layer of the linear order."""
    levels = pipedream_levels(cluster)
    states = states or pipedream_states(profile)
    if len(levels) > 1 and states.count > MAX_HIERARCHICAL_STATES:
        states = pipedream_states(profile, chain=True)
    choice = optimize(states, levels, scale=profile.scale(micro_batch_size), memory=memory)
    stages = _plan_stages(choice, states, profile.num_layers, levels)
    if stages is None or (max_replicas is not None and any(stage.replicas > max_replicas for stage in stages)):
        return None
    return PipeDreamResult(stages, choice.pipeline_ms, choice.data_parallel_ms)


def _plan_stages(choice: PipeDreamChoice, states: PipeDreamStates, num_layers: int, levels: list[Level]) -> tuple[StagePlan, ...] | None:
    """Layer ranges from state cuts; ranks per level as in the module docstring."""
    per = levels[0].machines if len(levels) == 2 else 1
    stages = []
    machine = 0
    offset = 0
    group = None
    for index, (start_row, end_state, units, groups) in enumerate(choice.stages):
        first = 0 if start_row == 0 else states.cut_position(start_row - 1)
        last = num_layers if index == len(choice.stages) - 1 else states.cut_position(end_state)
        if last <= first:
            return None
        if len(levels) == 2:
            if group is not None and groups[1] != group[0]:
                machine += group[1]
                offset = 0
            group = (groups[1], units[1])
            devices = tuple(sorted((machine + k) * per + offset + d for k in range(units[1]) for d in range(units[0])))
            offset += units[0]
        else:
            devices = tuple(range(offset, offset + units[0]))
            offset += units[0]
        stages.append(StagePlan(layers=(first, last), devices=devices))
    return tuple(stages)


def pipedream_minibatch(profile: ModelProfile, global_batch_size: int) -> int:
    """PipeDream's minibatch, the profile's batch per worker; refused unless it divides the
    global batch (a step is a whole number of minibatches)."""
    minibatch = profile.micro_batch_size
    require(
        global_batch_size % minibatch == 0,
        "global_batch_size",
        f"{global_batch_size} is not a multiple of PipeDream's minibatch, the profile's batch of {minibatch} samples per worker",
        f"use a multiple of {minibatch} (e.g. {max(1, round(global_batch_size / minibatch)) * minibatch}), or a profile taken at a batch that divides {global_batch_size}",
    )
    return minibatch


def pipedream_micro_batch_size(stages: tuple[StagePlan, ...], minibatch: int, global_batch_size: int) -> int:
    """The plan's micro-batch for PipeDream's stages: its minibatch, unless a stage has more
    replicas than the minibatch has samples; then the fewest whole minibatches that give
    every replica at least one sample and divide the global batch."""
    widest = max(stage.replicas for stage in stages)
    for size in range(minibatch, global_batch_size + 1, minibatch):
        if size >= widest and global_batch_size % size == 0:
            return size
    raise DappleConfigError(
        "global_batch_size",
        f"PipeDream replicates a stage over {widest} devices, more than the {global_batch_size} samples of the global batch",
        f"use a global batch of at least {widest} samples, or fewer devices",
    )


def _partition(request: PlanRequest, states: PipeDreamStates, minibatch: int, memory: float | None) -> tuple[PipeDreamResult, Scored]:
    """PipeDream's choice for its minibatch as plan stages, scored at the micro-batch
    ``pipedream_micro_batch_size`` gives them."""
    profile, cluster, global_batch_size = request.profile, request.cluster, request.global_batch_size
    result = pipedream_partition(profile, cluster, minibatch, states=states, memory=memory)
    if result is None:
        raise DappleConfigError(
            "profile",
            f"PipeDream's partition of {profile.num_layers} layers over {cluster.num_devices} devices puts two cuts on one layer of the linear order",
            "plan this model with the DAPPLE planner, or give a profile with one layer per operator",
        )
    count = global_batch_size // pipedream_micro_batch_size(result.stages, minibatch, global_batch_size)
    return result, score_stages(profile, cluster, result.stages, global_batch_size, count, request.policy, request.schedule)


def _reason(minibatch: int, result: PipeDreamResult, chosen: Scored, global_batch_size: int, constrained: bool) -> str:
    size = global_batch_size // chosen.micro_batches
    batches = f"M = {global_batch_size} / {minibatch} = {chosen.micro_batches}"
    if size != minibatch:
        batches = f"M = {chosen.micro_batches} micro-batches of {size // minibatch} minibatches (every replica gets a sample)"
    return (
        f"PipeDream 3.1: {chosen.kind()} plan (layers {':'.join(str(s.end - s.start) for s in chosen.stages)}) "
        f"minimises the slowest stage to {result.slowest_stage_ms:.1f} ms per minibatch of {minibatch} samples "
        f"(the profile's batch per worker); {batches} (formula 2: {chosen.latency_ms:.1f} ms)"
        + ("; with PipeDream's memory constraint (its unconstrained choice does not fit)" if constrained else "")
    )


def plan_pipedream(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "auto",
    num_devices: int | None = None,
    min_slice: int | None = None,
    simulate: StepPricer | None = None,
) -> Plan:
    """Plan with PipeDream's optimizer (3.1) for its minibatch, priced and scheduled like a
    DAPPLE plan; ``simulate`` (``simulate.plan_and_schedule.simulate_plan``) adds the simulated step to
    the result. ``micro_batches``, when given, must be the M that PipeDream's minibatch
    makes; ``min_slice`` is checked but binds nothing (PipeDream's replicas split its
    minibatch). ``policy`` "auto" runs the partition with the K_i policy it simulates faster
    with, as for DAPPLE's plans (``policy_choice``), so the two planners differ only in
    partitioning."""
    minibatch = pipedream_minibatch(profile, global_batch_size)
    request = PlanRequest.build(profile, cluster, global_batch_size, None, schedule, policy, num_devices, min_slice, simulate=simulate)
    cluster = request.cluster
    states = pipedream_states(profile)
    result, chosen = _partition(request, states, minibatch, None)
    constrained = not chosen.fits(cluster)
    if constrained:  # PipeDream's own memory constraint, off by default, on when its choice does not fit
        result, chosen = _partition(request, states, minibatch, cluster.device_memory_bytes)
    if not chosen.fits(cluster):
        raise_no_memory(profile, cluster, chosen.peak_memory_bytes, f"PipeDream's {chosen.kind()} plan, M={chosen.micro_batches}")
    require(
        micro_batches is None or micro_batches == chosen.micro_batches,
        "micro_batches",
        f"is {micro_batches}, but PipeDream plans for its minibatch of {minibatch} samples (the profile's batch per worker), "
        f"which makes M = {chosen.micro_batches} for a global batch of {global_batch_size}",
        f"leave the number of micro-batches out (or pass {chosen.micro_batches}) with the PipeDream planner",
    )
    choice = simulate_policies(request, chosen) if simulate is not None else None
    policy = choice.policy if choice is not None else request.policy
    sim = choice.simulation if choice is not None else None
    chosen = rescored(request, chosen, choice)
    reason = _reason(minibatch, result, chosen, global_batch_size, constrained)
    if choice is not None and choice.note():
        reason += "; " + choice.note()
    return finish_plan(chosen, profile, cluster, global_batch_size, policy, schedule, "pipedream", reason, sim, {"slowest_stage_ms": result.slowest_stage_ms})
