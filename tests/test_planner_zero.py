"""The planner prices ZeRO: a replicated stage that shards its optimizer state keeps 1/d of
it (memory), steps 1/d of it and exchanges the stepped parameters after the step (time);
``zero="auto"`` finds plans that fit or run faster only with sharding, and says so; plans
carry each stage's level through their JSON, and older files without it still load."""
from __future__ import annotations

import json

import pytest

from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import render_text
from lightning_dapple.plan.costs import (
    StageCost,
    dapple_latency,
    ring_ms,
    stage_costs,
    stage_memory_bytes,
    weight_state_bytes,
    zero_exchange_ms,
    zero_reduce_ms,
)
from lightning_dapple.plan.explain import plan_summary, plan_table
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan
from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan

MB = 1e6


def _cost(param_bytes: float, replicas: int, zero: int, stash: float = 10.0) -> StageCost:
    return StageCost(
        forward_ms=1.0, backward_ms=2.0, backward_input_ms=2.0, backward_weight_ms=0.0, param_bytes=param_bytes, stash_bytes=stash,
        output_bytes=0.0, send_ms=0.0, allreduce_ms=0.0, slice_size=1.0, replicas=replicas, zero=zero,
    )


def test_memory_keeps_one_share_of_the_optimizer_state() -> None:
    cluster = Cluster(1, 4, optimizer_state_factor=2.0)  # fp32 Adam: weights, gradients, two moments
    whole = _cost(400.0, 4, 0)
    assert stage_memory_bytes(whole, 3, cluster) == 400.0 * 4 + 3 * 10.0
    # ZeRO-1 on 4 replicas: weights and gradients whole, a quarter of the state
    assert stage_memory_bytes(_cost(400.0, 4, 1), 3, cluster) == 400.0 * (1 + 1 + 2 / 4) + 30.0
    # ZeRO-2: the gradients are whole at the step's peak (micro-batches add into them until the last one's buckets)
    assert weight_state_bytes(_cost(400.0, 4, 2), cluster) == 400.0 * 2.5
    # nothing to shard on one device; hand-made costs without the fields are priced as before
    assert stage_memory_bytes(_cost(400.0, 1, 1), 0, cluster) == 1600.0
    assert weight_state_bytes(_cost(400.0, 2, 1), Cluster(1, 2, optimizer_state_factor=0.0)) == 800.0  # plain SGD: no state


def _profile(layers: int = 4, param: float = 200 * MB, optimizer_ms: float = 8.0) -> ModelProfile:
    return ModelProfile(
        micro_batch_size=4,
        layers=tuple(
            LayerProfile(f"l{i}", forward_ms=1.0, backward_ms=2.0, output_bytes=1e5, param_bytes=param, stash_bytes=1e6, optimizer_ms=optimizer_ms)
            for i in range(layers)
        ),
    )


def test_stage_costs_charge_the_share_of_the_step_and_the_exchange() -> None:
    cluster = Cluster(1, 4, intra_bandwidth_gbps=80.0, latency_ms=0.05)
    profile = _profile()
    bpms = cluster.bytes_per_ms(80.0)
    params = 4 * 200 * MB
    plain = stage_costs(profile, cluster, (StagePlan((0, 4), (0, 1, 2, 3)),), 16)[0]
    one = stage_costs(profile, cluster, (StagePlan((0, 4), (0, 1, 2, 3), zero=1),), 16)[0]
    two = stage_costs(profile, cluster, (StagePlan((0, 4), (0, 1, 2, 3), zero=2),), 16)[0]
    # the collectives on the AllReduce's link model
    assert ring_ms(cluster, 2 * 3 / 4 * params, (0, 1, 2, 3)) == pytest.approx(cluster.allreduce_ms(params, (0, 1, 2, 3)))
    exchange = params / bpms + 4 * cluster.ring_latency_ms(4)  # one broadcast per owner, each of its quarter
    assert zero_exchange_ms(cluster, params, (0, 1, 2, 3)) == pytest.approx(exchange)
    assert zero_reduce_ms(cluster, params, (0, 1, 2, 3)) == pytest.approx(exchange)
    assert zero_exchange_ms(cluster, params, (0,)) == 0.0
    # ZeRO-1: a quarter of the optimizer step, then the exchange; the gradient sync unchanged
    assert plain.optimizer_ms == pytest.approx(32.0) and plain.exchange_ms == 0.0
    assert one.exchange_ms == pytest.approx(exchange)
    assert one.optimizer_ms == pytest.approx(32.0 / 4 + exchange)
    assert one.allreduce_ms == pytest.approx(plain.allreduce_ms) and one.buckets == plain.buckets
    assert (one.replicas, one.zero) == (4, 1)
    # ZeRO-2: the buckets are reduced onto their owners
    assert two.allreduce_ms == pytest.approx(zero_reduce_ms(cluster, params, (0, 1, 2, 3)))
    assert [d for _, d in two.buckets] == pytest.approx([zero_reduce_ms(cluster, 200 * MB, (0, 1, 2, 3))] * 4)
    # formula 2 sees the new tail: one stage, so the tail adds one to one
    assert dapple_latency([one], 4).latency_ms - dapple_latency([plain], 4).latency_ms == pytest.approx(one.tail_ms - plain.tail_ms)


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("devices", [(0, 1), (0, 1, 2, 3), (2, 5)])
def test_search_tables_price_the_tail_as_the_cost_model(zero: int, devices: tuple[int, ...]) -> None:
    """The search's vectorised tails (``RangeTables.tail``) equal ``StageCost.tail_ms``."""
    cluster = Cluster(2, 4, intra_bandwidth_gbps=80.0, inter_bandwidth_gbps=10.0, latency_ms=0.05)
    profile = _profile(layers=6, param=40 * MB)
    tables = RangeTables(profile)
    r = len(devices)
    a = 2.0 * (r - 1) / r / cluster.bytes_per_ms(cluster.ring_bandwidth_gbps(devices))
    scale = 4 / r / profile.micro_batch_size
    table = tables.tail(a, cluster.ring_latency_ms(r), scale, r, zero)
    for start in range(6):
        for end in range(start + 1, 7):
            cost = stage_costs(profile, cluster, (StagePlan((0, start), (7,)), StagePlan((start, end), devices, zero=zero)) if start else (StagePlan((start, end), devices, zero=zero),), 4)[-1]
            assert table[start, end] == pytest.approx(cost.tail_ms), (start, end)
            assert tables.tail_row(a, cluster.ring_latency_ms(r), scale, start, r, zero)[end] == pytest.approx(cost.tail_ms)
            assert tables.tail_column(a, cluster.ring_latency_ms(r), scale, end, r, zero)[start] == pytest.approx(cost.tail_ms)


def heavy_model(blocks: int = 8, block_gib: float = 0.5, optimizer_ms: float = 2.0) -> ModelProfile:
    """Eight equal blocks of 0.5 GiB of fp32 weights: 16 GiB with gradients and Adam's state."""
    layers = tuple(
        LayerProfile(f"block{i}", forward_ms=10.0, backward_ms=20.0, output_bytes=4e6, param_bytes=block_gib * GIB, stash_bytes=0.05 * GIB, optimizer_ms=optimizer_ms)
        for i in range(blocks)
    )
    return ModelProfile(micro_batch_size=4, layers=layers, name="heavy")


EIGHT_GIB = Cluster(1, 4, intra_bandwidth_gbps=2400.0, inter_bandwidth_gbps=100.0, device_memory_gib=8.0)


def test_zero_auto_finds_a_hybrid_plan_that_fits_only_with_sharding_and_runs_faster() -> None:
    profile = heavy_model()
    whole = make_plan(profile, EIGHT_GIB, 64, schedule="dapple")
    sharded = make_plan(profile, EIGHT_GIB, 64, schedule="dapple", zero="auto")
    # without sharding a replicated stage's 2 GiB of weights need 8 GiB plus its stash: only one device per stage fits
    assert whole.kind() == "straight" and all(stage.zero == 0 for stage in whole.stages)
    assert sharded.kind() == "2:2" and [stage.zero for stage in sharded.stages] == [1, 1]
    faster = simulate_plan(sharded, profile, EIGHT_GIB).latency_ms
    assert faster < simulate_plan(whole, profile, EIGHT_GIB).latency_ms * 0.97
    assert max(sharded.predicted.memory_bytes) <= EIGHT_GIB.device_memory_bytes
    # the same stages with every state whole would not fit, and the reason says why sharding is there
    unsharded = Plan(64, sharded.micro_batches, tuple(StagePlan(s.layers, s.devices) for s in sharded.stages))
    assert any(memory > EIGHT_GIB.device_memory_bytes for memory in PlanRequest.build(profile, EIGHT_GIB, 64).score(unsharded.stages, sharded.micro_batches).prediction.memory_bytes)
    assert "ZeRO-1 on stages 0, 1" in sharded.reason and "made the plan fit" in sharded.reason and "straight" in sharded.reason
    assert sharded.extra["zero_choice"]["stages"] == [1, 1]
    assert sharded.extra["zero_choice"]["without_zero"]["kind"] == "straight"
    text = render_text(plan_table(sharded, profile, EIGHT_GIB)) + plan_summary(sharded)
    assert " zero " in text and "made the plan fit" in text


def test_zero_auto_shards_where_the_saved_optimizer_step_outweighs_the_exchange() -> None:
    """Memory is plentiful; a slow optimizer step (80 ms per block on each replica) makes DP
    lose to a pipeline whose stages each step one block, until DP steps a quarter of the
    model on each replica and broadcasts the rest."""
    profile = heavy_model(blocks=4, block_gib=0.05, optimizer_ms=80.0)
    roomy = Cluster(1, 4, intra_bandwidth_gbps=2400.0, device_memory_gib=80.0)
    plain = make_plan(profile, roomy, 64, schedule="dapple")
    auto = make_plan(profile, roomy, 64, schedule="dapple", zero="auto")
    assert plain.kind() == "straight"
    assert auto.kind() == "DP" and auto.stages[0].zero == 1
    assert auto.predicted.simulated_latency_ms < plain.predicted.simulated_latency_ms * 0.9
    assert "ZeRO-1 on stage 0" in auto.reason and "made the plan faster" in auto.reason
    assert auto.extra["zero_choice"]["whole_ms"] > auto.predicted.simulated_latency_ms


def test_zero_auto_leaves_state_whole_where_sharding_does_not_pay() -> None:
    """No optimizer time to save and room to spare: the exchange only costs, nothing shards."""
    profile = heavy_model(blocks=4, block_gib=0.05, optimizer_ms=0.0)
    roomy = Cluster(1, 4, intra_bandwidth_gbps=100.0, device_memory_gib=80.0)
    auto = make_plan(profile, roomy, 64, schedule="dapple", zero="auto")
    assert all(stage.zero == 0 for stage in auto.stages)
    assert "ZeRO" not in auto.reason and "zero_choice" in auto.extra


def test_a_fixed_level_plans_every_replicated_stage_with_it() -> None:
    profile = heavy_model()
    plan = make_plan(profile, EIGHT_GIB, 64, schedule="dapple", zero=1)
    assert plan.kind() == "2:2" and [stage.zero for stage in plan.stages] == [1, 1]
    with pytest.raises(DappleConfigError, match="zero"):
        make_plan(profile, EIGHT_GIB, 64, schedule="dapple", zero=3)


def test_plan_json_round_trip_keeps_each_stages_level() -> None:
    plan = Plan(8, 2, (StagePlan((0, 2), (0, 1), zero=1), StagePlan((2, 3), (2,)), StagePlan((3, 4), (3, 4), zero=2))).validate()
    data = json.loads(plan.to_json())
    assert [stage.get("zero") for stage in data["stages"]] == [1, None, 2]  # 0 is left out, as the other defaults
    assert plan_from_dict(data) == plan


def test_old_plan_files_without_zero_load_unchanged() -> None:
    old = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 4], "devices": [2]}]}
    plan = plan_from_dict(old)
    assert [stage.zero for stage in plan.stages] == [0, 0]
    assert plan.to_dict()["stages"] == old["stages"]


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([{"layers": [0, 2], "devices": [0], "zero": 1}], "one device"),
        ([{"layers": [0, 2], "devices": [0, 1], "zero": 3}], "use one of"),
        ([{"layers": [0, 2], "devices": [0, 1], "zero": "1"}], "zero"),
    ],
)
def test_a_bad_level_is_refused_with_the_fix(stages: list, match: str) -> None:
    with pytest.raises(DappleConfigError, match=match):
        plan_from_dict({"global_batch_size": 8, "micro_batches": 2, "stages": stages})


def test_the_stages_of_one_device_group_share_a_level() -> None:
    stages = [StagePlan((k, k + 1), (0, 1) if k % 2 == 0 else (2, 3), zero=1 if k == 0 else 0) for k in range(4)]
    with pytest.raises(DappleConfigError, match="same devices"):
        Plan(8, 2, tuple(stages), schedule="interleaved").validate()


def test_the_users_level_is_applied_to_every_replicated_stage() -> None:
    plan = Plan(8, 2, (StagePlan((0, 2), (0, 1)), StagePlan((2, 4), (2,)))).validate()
    assert [s.zero for s in resolve_plan(plan, PlanArguments(zero=1, ooo=False)).stages] == [1, 0]
    given = Plan(8, 2, (StagePlan((0, 2), (0, 1), zero=1), StagePlan((2, 4), (2,)))).validate()
    for keeps in (PlanArguments(zero="auto", ooo=False), PlanArguments(zero=0, ooo=False), PlanArguments(ooo=False)):
        assert [s.zero for s in resolve_plan(given, keeps).stages] == [1, 0]  # the plan's own level
    assert PlanArguments(zero="auto").planner_kwargs()["zero"] == "auto"
    assert "zero" not in PlanArguments(zero=0).planner_kwargs()
    with pytest.raises(DappleConfigError, match="zero"):
        PlanArguments(zero="yes")


def test_chunked_schedules_keep_each_device_groups_level() -> None:
    """``schedule="auto"`` cuts the planner's 2:2 ZeRO-1 plan into chunks on the same device
    groups: every chunk keeps its group's level (the runtime shards a rank's whole optimizer)."""
    plan = make_plan(heavy_model(), EIGHT_GIB, 64, schedule="auto", zero="auto")
    assert plan.chunks > 1 and plan.kind().startswith("2:2")
    assert all(stage.zero == 1 for stage in plan.stages)
    assert plan.validate() is plan


def test_the_nccl_reserve_can_rule_out_the_sharded_hybrid() -> None:
    """At 544 MB per communicator the 2:2 plan's four per rank (the default group, its replica
    group, one link's two directions) no longer fit beside its 6.6 GiB: the straight pipeline
    (three or five per rank, no replicas) runs, with its counts recorded."""
    plan = make_plan(heavy_model(), EIGHT_GIB, 64, schedule="dapple", zero="auto", communicator_bytes=544e6)
    assert plan.kind() == "straight"
    assert plan.extra["communicators"] == {"reserve_bytes": 544e6, "per_rank": {"0": 3, "1": 5, "2": 5, "3": 3}}
    assert max(plan.predicted.memory_bytes) <= EIGHT_GIB.device_memory_bytes
