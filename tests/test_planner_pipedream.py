"""The PipeDream baseline picks what PipeDream's own optimizer picks (PipeDream 3.1), for
its own minibatch (the profile's batch per worker), through the function and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_dapple.cli.plan import main as dapple_plan
from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.pipedream_optimizer import Level, optimize
from lightning_dapple.plan.pipedream_planner import pipedream_levels, pipedream_micro_batch_size, pipedream_partition, plan_pipedream
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.pipedream_states import pipedream_states
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate.plan_and_schedule import make_plan
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


FLAT_16 = {"name": "flat-16", "machines": 16, "devices_per_machine": 1, "inter_bandwidth_gbps": 200.0}  # 25 GB/s
PIPEDREAMS_CHOICE = "10:1:1:1:1:1:1"


def test_the_planner_hands_pipedream_its_minibatch(resnet50: ModelProfile) -> None:
    """GBS 1024 at 64 per worker: M = 16 micro-batches of PipeDream's minibatch, and the
    plan is PipeDream's own choice, priced and simulated like any plan."""
    plan = make_plan(resnet50, Cluster(16, 1, inter_bandwidth_gbps=200.0), 1024, planner="pipedream")
    assert plan.kind() == PIPEDREAMS_CHOICE
    assert (plan.micro_batches, plan.micro_batch_size) == (16, 64)
    assert plan.predicted is not None and plan.predicted.simulated_latency_ms is not None
    assert "M = 1024 / 64 = 16" in plan.reason


def test_a_global_batch_that_is_not_whole_minibatches_is_refused(resnet50: ModelProfile) -> None:
    with pytest.raises(DappleConfigError, match="not a multiple of PipeDream's minibatch.*64") as caught:
        plan_pipedream(resnet50, Cluster(16, 1, inter_bandwidth_gbps=200.0), 1000)
    assert "use a multiple of 64 (e.g. 1024)" in str(caught.value)


def test_another_number_of_micro_batches_is_refused(resnet50: ModelProfile) -> None:
    with pytest.raises(DappleConfigError, match="makes M = 16"):
        plan_pipedream(resnet50, Cluster(16, 1, inter_bandwidth_gbps=200.0), 1024, micro_batches=1)


def test_replicas_beyond_the_minibatch_take_whole_minibatches() -> None:
    """A profile taken at batch 1 whose PipeDream choice replicates a stage 3 ways: a
    micro-batch of one sample cannot be split over 3 replicas, so it holds the fewest whole
    minibatches that can and divide the global batch."""
    stages = (StagePlan(layers=(0, 2), devices=(0, 1, 2)), StagePlan(layers=(2, 4), devices=(3,)))
    assert pipedream_micro_batch_size(stages, 1, 12) == 3
    assert pipedream_micro_batch_size(stages, 1, 8) == 4  # 3 does not divide 8
    assert pipedream_micro_batch_size(stages, 4, 8) == 4  # the minibatch when it suffices
    with pytest.raises(DappleConfigError, match="over 3 devices"):
        pipedream_micro_batch_size(stages, 1, 2)
    heavy = tuple(LayerProfile(f"l{i}", 10.0 if i == 0 else 1.0, 20.0 if i == 0 else 2.0, 1e3, 1e3, 1e3) for i in range(4))
    plan = make_plan(ModelProfile(1, heavy), Cluster(4, 1), 12, planner="pipedream")
    widest = max(stage.replicas for stage in plan.stages)
    assert widest > 1 and plan.micro_batch_size == pipedream_micro_batch_size(plan.stages, 1, 12) >= widest


def test_the_cli_plans_pipedreams_choice(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cluster = tmp_path / "flat-16.json"
    cluster.write_text(json.dumps(FLAT_16))
    argv = ["--planner", "pipedream", "--profile", str(RESNET50), "--cluster", str(cluster), "--global-batch-size", "1024", "--profile-batch-size", "64"]
    assert dapple_plan(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["planner"] == "pipedream" and data["micro_batches"] == 16
    assert ":".join(str(len(stage["devices"])) for stage in data["stages"]) == PIPEDREAMS_CHOICE
    assert dapple_plan(argv) == 0
    assert f"{PIPEDREAMS_CHOICE} plan for resnet50.graph.txt: M=16" in capsys.readouterr().out
    assert dapple_plan(argv[:-3] + ["1000", "--profile-batch-size", "64"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: global_batch_size: 1000 is not a multiple of PipeDream's minibatch") and "\n" not in error
