"""The lower bound on any plan of one shape (``plan/shape_bound.py``): it never exceeds a
simulated step of a plan of that shape, and its straight-pipeline DP is the exact minimum
over every cut of the relaxation it solves."""
from __future__ import annotations

import itertools
import random

import pytest
from conftest import shared_profiles

from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.shape_bound import shape_lower_bound, synced_step_lower_bound
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.profile import load_profile
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate import simulate_plan

PROFILES = shared_profiles()


def _chain(layers: int, seed: int) -> ModelProfile:
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        f = rng.uniform(0.5, 4.0)
        out.append(LayerProfile(f"layer{i}", f, rng.uniform(1.5, 2.5) * f, rng.uniform(1e5, 8e6), rng.uniform(1e6, 4e7), rng.uniform(1e6, 1e7)))
    return ModelProfile(2, tuple(out), name=f"chain-{layers}-{seed}")


def _runs(plan_stages: tuple[StagePlan, ...], gbs: int, m: int) -> list[Plan]:
    """The plan under P_A, P_B (K_i as warmup_counts gives them) and GPipe."""
    plans = []
    for schedule, policy in (("dapple", "PA"), ("dapple", "PB"), ("gpipe", "PA")):
        counts = warmup_counts(len(plan_stages), m, policy, schedule)
        stages = tuple(StagePlan(stage.layers, stage.devices, warmup=k) for stage, k in zip(plan_stages, counts))
        plans.append(Plan(gbs, m, stages, schedule=schedule, policy=policy))
    return plans


def _layouts(n: int, replicas: tuple[int, ...], rng: random.Random, count: int) -> list[tuple[StagePlan, ...]]:
    firsts = list(itertools.accumulate((0, *replicas)))
    devices = [tuple(range(firsts[i], firsts[i + 1])) for i in range(len(replicas))]
    out = []
    for _ in range(count):
        cuts = [0, *sorted(rng.sample(range(1, n), len(replicas) - 1)), n]
        out.append(tuple(StagePlan((cuts[i], cuts[i + 1]), devices[i]) for i in range(len(replicas))))
    return out


@pytest.mark.parametrize(
    "name,cluster_name,gbs",
    [("gnmt-16-pbs-64.txt", "paper-c", 1024), ("xlnet-36-pbs-1.txt", "paper-b", 128), ("amoeba-36-pbs-1.txt", "paper-a", 128)],
)
def test_no_plan_of_the_shape_steps_faster_than_its_bound(name: str, cluster_name: str, gbs: int) -> None:
    profile = load_profile(PROFILES / "dapple" / name)
    cluster = load_cluster(cluster_name)
    request = PlanRequest.build(profile, cluster, gbs)
    rng = random.Random(name)
    checked = 0
    for shape, replicas in (("DP", (16,)), ("straight", (1,) * 16), ("8:8", (8, 8)), ("11:5", (11, 5))):
        found = shape_lower_bound(request, shape)
        assert found is not None, shape
        bound = found[0]
        valid = [m for m in request.micro_batches if max(replicas) <= (gbs // m) // request.floor]
        for m in valid[-2:]:
            mbs = gbs // m
            layouts = [(StagePlan((0, profile.num_layers), tuple(range(16))),)] if shape == "DP" else _layouts(profile.num_layers, replicas, rng, 3)
            for stages in layouts:
                # the bound of one plan holds for it, and the shape's bound is below it
                costs = stage_costs(profile, cluster, stages, mbs)
                assert bound <= synced_step_lower_bound(costs, m) * (1 + 1e-9), (shape, stages, m)
                for plan in _runs(stages, gbs, m):
                    simulated = simulate_plan(plan, profile, cluster).latency_ms
                    assert synced_step_lower_bound(costs, m) <= simulated * (1 + 1e-9), (shape, stages, m, plan.schedule, plan.policy)
                    checked += 1
    assert checked >= 27


@pytest.mark.parametrize("seed", range(4))
def test_straight_bound_is_the_minimum_over_every_cut(seed: int) -> None:
    # the bottleneck DP against brute force over every cut of 9 layers into 4 stages, with
    # each cut's transfers priced at the cheapest they can be (what the DP assumes); and
    # never above the per-plan bound of any straight plan
    profile = _chain(9, seed)
    cluster = Cluster(2, 2, intra_bandwidth_gbps=80.0, inter_bandwidth_gbps=10.0, latency_ms=0.05 * seed)
    gbs = 16
    request = PlanRequest.build(profile, cluster, gbs)
    devices = [(rank,) for rank in range(4)]
    unit = min(cluster.p2p_ms(1.0, (t - 1,), (t,)) - cluster.latency_ms for t in range(1, 4))
    for m in request.micro_batches:
        mbs = gbs // m
        scale = profile.scale(mbs)
        brute, per_plan = float("inf"), float("inf")
        for inner in itertools.combinations(range(1, 9), 3):
            cuts = (0, *inner, 9)
            stages = tuple(StagePlan((cuts[i], cuts[i + 1]), devices[i]) for i in range(4))
            per_plan = min(per_plan, synced_step_lower_bound(stage_costs(profile, cluster, stages, mbs), m))
            worst, forward, back, path = 0.0, 0.0, 0.0, 0.0
            for s in range(4):
                a, b = cuts[s], cuts[s + 1]
                if s:
                    earlier = sorted(profile.layers[c - 1].output_bytes * scale * unit + cluster.latency_ms for c in range(1, a))
                    path = profile.layers[a - 1].output_bytes * scale * unit + cluster.latency_ms + sum(earlier[: s - 1])
                own = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers[a:b]) * scale
                worst = max(worst, forward + back + 2 * path + m * own)
                forward += sum(layer.forward_ms for layer in profile.layers[a:b]) * scale
                back += sum(min(layer.input_grad_ms, layer.backward_ms) for layer in profile.layers[a:b]) * scale
            brute = min(brute, worst)
        dp = shape_lower_bound(PlanRequest.build(profile, cluster, gbs, micro_batches=m), "straight")
        assert dp is not None and dp[1] == m
        assert dp[0] == pytest.approx(brute, rel=1e-9)
        assert dp[0] <= per_plan * (1 + 1e-9)


def test_shapes_it_does_not_bound_are_refused() -> None:
    from lightning_dapple.errors import DappleConfigError

    request = PlanRequest.build(_chain(6, 0), Cluster(1, 4), 8)
    with pytest.raises(DappleConfigError, match="P:Q"):
        shape_lower_bound(request, "2:1:1")
    assert shape_lower_bound(request, "3:3") is None  # six devices on a cluster of four
    assert shape_lower_bound(request, "2:2") is not None
