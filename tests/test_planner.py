"""DAPPLE planner pieces: placement policies (4.2), memory filter, M selection, the obvious
DP/pipeline decisions, the plan JSON, and the PipeDream baseline (PipeDream 3.2)."""
from __future__ import annotations

import itertools
import json
import random

import pytest

from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs, stage_memory_bytes
from lightning_dapple.plan.dapple_planner import dapple_search, p2p_ms_fast, search_effort
from lightning_dapple.plan.evaluate import candidate_micro_batches
from lightning_dapple.plan.pipedream_planner import pipedream_partition
from lightning_dapple.plan.placement import (
    PlacementState,
    append_first,
    append_near,
    fresh_first,
    placement_options,
    scatter_first,
)
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.simulate.plan_and_schedule import make_plan


def chain(n: int, forward: float = 2.0, params: float = 1e6, output: float = 1e6, stash: float = 1e6, pbs: int = 1) -> ModelProfile:
    layers = tuple(LayerProfile(f"layer{i}", forward, 2 * forward, output, params, stash) for i in range(n))
    return ModelProfile(pbs, layers, name=f"chain{n}")


# --------------------------------------------------------------------------- placement


def fig5_state() -> PlacementState:
    """DAPPLE Fig. 5 (a): three machines of 8; machine 0 full, ranks 8-11 of machine 1 taken."""
    return PlacementState.of(Cluster(3, 8), range(12))


def test_fig5_policies() -> None:
    state = fig5_state()
    assert fresh_first(state, 6) == (16, 17, 18, 19, 20, 21)  # a fresh machine
    assert append_first(state, 6) == (12, 13, 14, 15, 16, 17)  # fill machine 1, then spill
    assert scatter_first(state, 6) == (12, 13, 14, 16, 17, 18)  # evenly over machines with room


def test_policies_on_an_empty_cluster_and_impossible_requests() -> None:
    empty = PlacementState.empty(Cluster(2, 8))
    assert fresh_first(empty, 8) == tuple(range(8))
    assert append_first(empty, 8) == tuple(range(8))  # nothing in use yet: like Fresh First
    assert scatter_first(empty, 8) == (0, 1, 2, 3, 8, 9, 10, 11)  # "equally from all machines if they are all fresh"
    assert scatter_first(empty, 5) == (0, 1, 2, 8, 9)
    full = PlacementState.of(Cluster(2, 2), range(3))
    for policy in (fresh_first, append_first, scatter_first):
        assert policy(full, 2) is None
        assert policy(full, 1) == (3,)
    with pytest.raises(DappleConfigError):
        fresh_first(empty, 0)


def test_scatter_prefers_used_machines_with_room() -> None:
    state = PlacementState.of(Cluster(3, 4), [0, 4])  # machines 0 and 1 in use, 2 fresh
    assert scatter_first(state, 4) == (1, 2, 5, 6)
    assert append_first(state, 2) == (1, 2)
    assert append_near(state, 2, near=(4,)) == (5, 6)  # next to the previous stage


def test_placement_options_are_distinct_and_deterministic() -> None:
    state = PlacementState.of(Cluster(2, 4), [0])
    first = placement_options(state, 3, near=(0,))
    assert first == placement_options(state, 3, near=(0,))
    assert len({ranks for _, ranks in first}) == len(first)
    assert [name for name, _ in first][:1] == ["fresh_first"]
    assert all(len(ranks) == 3 and 0 not in ranks for _, ranks in first)


def test_fast_split_concat_matches_cluster() -> None:
    rng = random.Random(3)
    for _ in range(500):
        cluster = Cluster(rng.randint(1, 4), rng.randint(1, 8), intra_bandwidth_gbps=2400, inter_bandwidth_gbps=rng.choice([10, 25]), latency_ms=rng.choice([0.0, 0.02]))
        ranks = list(range(cluster.num_devices))
        if len(ranks) < 2:
            continue
        rng.shuffle(ranks)
        a = rng.randint(1, len(ranks) - 1)
        b = rng.randint(1, len(ranks) - a)
        senders, receivers = tuple(sorted(ranks[:a])), tuple(sorted(ranks[a : a + b]))
        size = rng.choice([0.0, 1.0, 3e6])
        assert p2p_ms_fast(cluster, size, senders, receivers) == cluster.p2p_ms(size, senders, receivers)
        # overlapping sets (a rank passing rows to itself moves nothing) and empty sides
        overlapping = tuple(sorted(rng.sample(ranks, rng.randint(1, len(ranks)))))
        assert p2p_ms_fast(cluster, 3e6, senders, overlapping) == cluster.p2p_ms(3e6, senders, overlapping)
        assert p2p_ms_fast(cluster, 3e6, (), receivers) == cluster.p2p_ms(3e6, (), receivers) == 0.0


# --------------------------------------------------------------------------- M and memory


def test_micro_batch_candidates_respect_the_slice_floor() -> None:
    assert candidate_micro_batches(64, 2) == ([1, 2, 4, 8, 16, 32], 2)
    assert candidate_micro_batches(64, 2, micro_batches=64) == ([64], 1)  # the user asked for it
    with pytest.raises(DappleConfigError, match="cannot be split into 7"):
        candidate_micro_batches(64, 2, micro_batches=7)
    with pytest.raises(DappleConfigError, match="global_batch_size"):
        candidate_micro_batches(3, 4)


def test_chosen_plan_keeps_every_slice_at_least_the_profile_batch() -> None:
    profile = chain(12, pbs=4)
    for name in ("2x4", "8x1"):
        plan = make_plan(profile, load_cluster(name), 256)
        assert 256 % plan.micro_batches == 0
        for stage in plan.stages:
            assert plan.micro_batch_size / stage.replicas >= 4
    # a given M is used as is
    assert make_plan(profile, load_cluster("2x4"), 256, micro_batches=8).micro_batches == 8


def test_memory_filter_and_reported_memory() -> None:
    profile = chain(8, params=2e8, stash=5e7)
    cluster = Cluster(2, 4, device_memory_gib=4.0)
    for item in dapple_search(profile, cluster, 64, keep=4):
        assert item.fits(cluster)
    plan = make_plan(profile, cluster, 64)
    costs = stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)
    counts = warmup_counts(plan.num_stages, plan.micro_batches, plan.policy)
    expected = [stage_memory_bytes(cost, k, cluster) for cost, k in zip(costs, counts)]
    assert list(plan.predicted.memory_bytes) == pytest.approx(expected)
    assert max(expected) <= cluster.device_memory_bytes
    assert [stage.warmup for stage in plan.stages] == counts
    # DP would need 8 x 2e8 x 4 bytes = 6 GiB of weights, gradients and Adam state per device
    assert plan.kind() != "DP"


def test_impossible_memory_names_the_need_and_the_fix() -> None:
    profile = chain(4, params=5e9)
    cluster = Cluster(1, 4, device_memory_gib=16.0)
    with pytest.raises(DappleConfigError) as info:
        make_plan(profile, cluster, 16)
    error = info.value
    assert error.field == "cluster.device_memory_gib"
    assert "no plan fits" in error.problem and "GiB per device" in error.problem
    needed = float(error.problem.split("needs ")[1].split(" GiB")[0])
    assert needed == pytest.approx(5e9 * 4 / 1024**3, rel=0.01)  # one 5 GB layer: weights, grads, Adam
    assert "more devices" in error.fix and "recomputation" in error.fix


# --------------------------------------------------------------------------- decisions


def test_tiny_weights_and_huge_activations_choose_dp() -> None:
    profile = chain(6, forward=10.0, params=1e3, output=2e9, stash=1e6)
    plan = make_plan(profile, Cluster(2, 4, inter_bandwidth_gbps=25), 64)
    assert plan.kind() == "DP"
    assert plan.reason.startswith("DP:")


def test_huge_weights_on_a_slow_network_choose_a_pipeline() -> None:
    profile = chain(8, forward=10.0, params=2.5e8, output=1e5, stash=1e6)
    cluster = Cluster(8, 1, inter_bandwidth_gbps=1, device_memory_gib=64)
    plan = make_plan(profile, cluster, 64)
    assert plan.kind() not in ("DP", "single")
    assert plan.num_stages >= 2
    assert "would cost" in plan.reason and "under DP" in plan.reason
    assert all(stage.replicas == 1 for stage in plan.stages)  # any replication pays the 1 Gbit/s AllReduce


def test_plan_is_valid_complete_and_round_trips_through_json(tmp_path) -> None:
    profile = chain(10, forward=3.0, params=5e7)
    cluster = load_cluster("2x4")
    plan = make_plan(profile, cluster, 128)
    plan.validate(num_layers=10, world_size=8)
    assert plan.planner == "dapple" and plan.reason
    assert plan.predicted is not None and plan.predicted.simulated_latency_ms is not None
    assert plan.predicted.bubble_fraction is not None and 0 <= plan.predicted.bubble_fraction < 1
    assert len(plan.predicted.memory_bytes) == plan.num_stages
    again = plan_from_dict(json.loads(plan.to_json()))
    assert again.stages == plan.stages and again.micro_batches == plan.micro_batches
    assert again.predicted == plan.predicted and again.reason == plan.reason
    saved = plan.save(tmp_path / "plan.json")
    assert plan_from_dict(json.loads(saved.read_text())).stages == plan.stages


def test_num_devices_plans_for_part_of_the_cluster() -> None:
    plan = make_plan(chain(8), load_cluster("2x8"), 64, num_devices=8)
    assert plan.world_size == 8
    with pytest.raises(DappleConfigError, match="num_devices"):
        make_plan(chain(8), load_cluster("2x8"), 64, num_devices=12)


def test_search_effort_by_instance_size() -> None:
    assert search_effort(8, 8) == (4, None)
    assert search_effort(53, 16) == (2, 16)
    assert search_effort(128, 64) == (2, 8)
    assert search_effort(53, 16, keep_per_state=3, beam=None) == (3, None)


# --------------------------------------------------------------------------- PipeDream


def _slowest(profile: ModelProfile, cuts: list[int], replicas: list[int], mbs: int, cluster: Cluster) -> float:
    """PipeDream's objective on a flat cluster as its optimizer computes it (PipeDream 3.1):
    a stage on r workers takes (compute + 4 (r-1) |w| / (B r)) / r; activations are free."""
    whole = mbs / profile.micro_batch_size
    bpm = cluster.bytes_per_ms(cluster.inter_bandwidth_gbps)
    worst = 0.0
    for s, r in enumerate(replicas):
        layers = profile.layers[cuts[s] : cuts[s + 1]]
        compute = sum((l.forward_ms + l.backward_ms) * whole for l in layers)
        sync = 4.0 * (r - 1) * sum(l.param_bytes for l in layers) / (bpm * r)
        worst = max(worst, (compute + sync) / r)
    return worst


def test_pipedream_recurrence_is_optimal_for_its_objective() -> None:
    rng = random.Random(5)
    for _ in range(15):
        n = rng.randint(2, 6)
        layers = tuple(
            LayerProfile(f"l{i}", rng.uniform(1, 5), rng.uniform(1, 9), rng.choice([1e5, 1e7, 1e8]), rng.choice([0, 1e7, 3e8]), 1e6)
            for i in range(n)
        )
        profile = ModelProfile(1, layers)
        cluster = Cluster(rng.randint(2, 5), 1, inter_bandwidth_gbps=rng.choice([10, 25]))
        g = cluster.num_devices
        result = pipedream_partition(profile, cluster, 8, max_replicas=8)
        best = float("inf")
        for count in range(1, min(n, g) + 1):
            for inner in itertools.combinations(range(1, n), count - 1):
                for split in itertools.combinations(range(1, g), count - 1):
                    sizes = [b - a for a, b in zip((0, *split), (*split, g))]
                    best = min(best, _slowest(profile, [0, *inner, n], sizes, 8, cluster))
        assert result is not None
        assert result.slowest_stage_ms == pytest.approx(best, rel=1e-9)
        assert sum(stage.replicas for stage in result.stages) == g


def test_pipedream_planner_returns_a_valid_plan() -> None:
    profile = chain(12, forward=3.0, params=5e7)
    for name in ("2x4", "8x1", "1x4"):
        cluster = load_cluster(name)
        plan = make_plan(profile, cluster, 64, planner="pipedream")
        plan.validate(num_layers=12, world_size=cluster.num_devices)
        assert plan.planner == "pipedream" and plan.predicted is not None
        assert plan.predicted.simulated_latency_ms is not None
        assert all(stage.warmup is not None for stage in plan.stages)
        for stage in plan.stages:  # ranks in order, one block of machines per stage group
            assert list(stage.devices) == sorted(stage.devices)
