"""The layer cut for a plan the user gave by its shape (``PlanShape``: devices per stage).

DAPPLE's planner (section 4) searches shapes and cuts together. A user who knows the shape
they want ("two stages, one GPU each") but not the model's layer count gives only the
devices; the planner's own fixed-shape machinery then cuts the layers: for every M the
bottleneck DP of ``baselines.shape_candidates`` (the cut the planner also offers as every
candidate's balanced twin), priced by formula 2, re-ranked by the simulator when one is
given, with the K_i policy that simulates faster when the shape leaves it open.
"""
from __future__ import annotations

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import require
from lightning_dapple.plan.baselines import shape_candidates
from lightning_dapple.plan.evaluate import Scored, finish_plan
from lightning_dapple.plan.options import set_options
from lightning_dapple.plan.plan import Plan, PlanShape
from lightning_dapple.plan.policy_choice import (
    PolicyChoice,
    rescored,
    simulate_policies,
)
from lightning_dapple.plan.request import PlanRequest, StepPricer
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["plan_shape"]


def _choose(request: PlanRequest, candidates: list[Scored]) -> tuple[Scored, PolicyChoice | None]:
    """The formula's best, or, with a simulator, the fastest simulated of the first
    ``request.rerank`` (as ``dapple_planner`` re-ranks its shortlist)."""
    if request.simulate is None:
        return candidates[0], None
    simulated = [(item, simulate_policies(request, item)) for item in candidates[: max(1, request.rerank)]]
    return min(simulated, key=lambda pair: (pair[1].simulation.latency_ms, pair[0].micro_batches))


def plan_shape(profile: ModelProfile, cluster: Cluster, shape: PlanShape, simulate: StepPricer | None = None) -> Plan:
    """The plan of ``shape`` with the layer cut (and M, where the shape leaves it open)
    chosen for ``profile`` on ``cluster``."""
    shape.validate()
    require(
        shape.world_size <= cluster.num_devices,
        "plan.stages[].devices",
        f"use {shape.world_size} ranks but the cluster has {cluster.num_devices} devices",
        f"give at most {cluster.num_devices} ranks",
    )
    stages = len(shape.devices)
    require(
        profile.num_layers >= stages,
        "plan.stages",
        f"ask for {stages} stages but the model has {profile.num_layers} layers",
        f"use at most {profile.num_layers} stages, or give the model more layers",
    )
    request = PlanRequest.build(
        profile, cluster, shape.global_batch_size, shape.micro_batches, shape.schedule, shape.policy or "auto",
        num_devices=shape.world_size, min_slice=1, simulate=simulate,
    )
    candidates = shape_candidates(request, shape.devices)
    require(
        bool(candidates),
        "plan.stages",
        f"no cut of the {profile.num_layers} layers into these {stages} stages fits in {cluster.name}'s device memory at any M",
        "give more devices per stage, more stages, or a smaller global batch",
    )
    chosen, choice = _choose(request, candidates)
    policy = choice.policy if choice is not None else request.policy
    cuts = ", ".join(f"[{stage.start}, {stage.end})" for stage in chosen.stages)
    reason = f"the given shape; the planner cut the {profile.num_layers} layers into {cuts} (slowest stage smallest, M={chosen.micro_batches})"
    plan = finish_plan(
        rescored(request, chosen, choice), profile, request.cluster, shape.global_batch_size, policy, shape.schedule, "dapple-shape",
        reason, choice.simulation if choice is not None else None,
    )
    return set_options(plan, recompute=list(shape.recompute)) if shape.recompute else plan
