"""The PipeDream baseline picks what PipeDream's own optimizer picks (PipeDream 3.1)."""
from __future__ import annotations


import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.pipedream_optimizer import Level, optimize
from lightning_dapple.plan.pipedream_planner import pipedream_levels, pipedream_partition
from lightning_dapple.plan.pipedream_states import pipedream_states
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.profile.loader import load_profile
from conftest import shared_profiles

RESNET50 = shared_profiles() / "pipedream" / "resnet50.graph.txt"


@pytest.fixture(scope="module")
def resnet50() -> ModelProfile:
    return load_profile(RESNET50, profile_batch_size=64)


def test_resnet50_has_pipedreams_240_states(resnet50: ModelProfile) -> None:
    states = pipedream_states(resnet50)
    assert resnet50.num_layers == 177 and states.count == 240
    # the input node is set aside, every other node's time is counted once
    total = sum(layer.forward_ms + layer.backward_ms for layer in resnet50.layers if layer.name != "Input")
    assert states.compute_ms[-1] == pytest.approx(total)


def test_resnet50_flat_16_workers_matches_pipedreams_choice(resnet50: ModelProfile) -> None:
    """PipeDream's optimizer on this profile, 16 workers on one 25 GB/s level, batch 64 per
    worker: a 7-stage pipeline whose first stage has 10 replicas, 1.018x over DP."""
    choice = optimize(pipedream_states(resnet50), [Level(16, 25e9 / 1e3)])
    replicas = [units[0] for _, _, units, _ in choice.stages]
    assert len(replicas) == 7 and replicas[0] == 10 and sum(replicas) == 16
    assert choice.speedup_over_dp == pytest.approx(1.018, abs=5e-4)


def test_the_plan_follows_the_choice(resnet50: ModelProfile) -> None:
    cluster = Cluster(16, 1, inter_bandwidth_gbps=200.0)  # 25 GB/s
    assert pipedream_levels(cluster) == [Level(16, 25e9 / 1e3)]
    result = pipedream_partition(resnet50, cluster, 64)
    assert result is not None
    assert [stage.replicas for stage in result.stages][:1] == [10] and len(result.stages) == 7
    assert result.stages[0].start == 0 and result.stages[-1].end == 177
    assert all(a.end == b.start for a, b in zip(result.stages, result.stages[1:]))
    assert result.data_parallel_ms / result.slowest_stage_ms == pytest.approx(1.018, abs=5e-4)


def test_a_chain_has_one_state_per_layer_and_hierarchical_levels() -> None:
    layers = tuple(LayerProfile(f"l{i}", 1.0 + i, 2.0, 1e6, 1e7 * (i + 1), 1e6) for i in range(6))
    states = pipedream_states(ModelProfile(1, layers))
    assert states.count == 6 and states.ancestors[5, :5].all() and not states.ancestors[0].any()
    cluster = Cluster(2, 4)
    assert [level.machines for level in pipedream_levels(cluster)] == [4, 2]
    choice = optimize(states, pipedream_levels(cluster))
    assert sum(units[0] * units[1] for _, _, units, _ in choice.stages) <= 8
    assert choice.pipeline_ms <= choice.data_parallel_ms + 1e-9  # DP is one of its options


def test_straight_pipeline_option() -> None:
    """PipeDream's --straight_pipeline: every stage on one worker, all workers used."""
    layers = tuple(LayerProfile(f"l{i}", 1.0 + i, 2.0, 1e6, 1e7, 1e6) for i in range(6))
    states = pipedream_states(ModelProfile(1, layers))
    straight = optimize(states, [Level(3, 1e6)], straight=True)
    assert [units for _, _, units, _ in straight.stages] == [(1,), (1,), (1,)]
    free = optimize(states, [Level(3, 1e6)])
    assert free.pipeline_ms <= straight.pipeline_ms + 1e-9
    # the slowest stage of the straight choice is the best three-way cut of the chain
    work = [1.0 + i + 2.0 for i in range(6)]
    best = min(
        max(sum(work[:a]), sum(work[a:b]), sum(work[b:]))
        for a in range(1, 5) for b in range(a + 1, 6)
    )
    assert straight.pipeline_ms == pytest.approx(best)
