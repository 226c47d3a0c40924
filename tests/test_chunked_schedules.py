"""Schedules with several stages (chunks) per device group: interleaved 1F1B and ZB-V.

Every built schedule is checked for what the executor relies on (each stage runs each
micro-batch's F and backward exactly once, in an order the simulator can complete, and
each group's merged order is its stages' lists interleaved), and against the closed forms
where the papers give one: Megatron's interleaved step (M + (P-1)/v)(F+B) (Narayanan et al.
2021, sec. 2.2.2) and ZB-V's 6M + P - 1 units at F = I = W (zero-bubble V schedule).
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from stage_costs import cost

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict
from lightning_dapple.schedule.actions import Action, Kind, Schedule, group_stash_walk
from lightning_dapple.schedule.builders import build_schedule
from lightning_dapple.schedule.interleaved import build_interleaved_schedule
from lightning_dapple.schedule.zbv import build_zbv_schedule
from lightning_dapple.simulate.engine import ScheduleDeadlock, simulate
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

GROUPS = (2, 3, 4)


def interleaved_cases() -> list[tuple[int, int, int]]:
    return [(p, v, m) for p in GROUPS for v in (2, 3) for m in range(p, 5 * p + 1, p)]


def zbv_cases() -> list[tuple[int, int]]:
    return [(p, m) for p in GROUPS for m in range(1, 4 * p + 2)]


def all_schedules() -> list[Schedule]:
    built = [build_interleaved_schedule(p, v, m) for p, v, m in interleaved_cases()]
    built += [build_interleaved_schedule(p, v, m, policy="PB") for p, v, m in interleaved_cases()]
    return built + [build_zbv_schedule(p, m) for p, m in zbv_cases()]


SCHEDULES = all_schedules()


def chunked_plan(schedule: str, groups: int, chunks: int, micro_batches: int, **fields: object) -> Plan:
    placement = [k if k < groups else 2 * groups - 1 - k for k in range(2 * groups)] if schedule == "zbv" else [k % groups for k in range(groups * chunks)]
    stages = tuple(StagePlan((k, k + 1), (placement[k],)) for k in range(len(placement)))
    return Plan(global_batch_size=micro_batches * 2, micro_batches=micro_batches, stages=stages, schedule=schedule, **fields)  # type: ignore[arg-type]


def test_every_stage_runs_each_microbatch_once_with_its_transfers() -> None:
    for schedule in SCHEDULES:
        m, last = schedule.micro_batches, schedule.num_stages - 1
        split = schedule.name == "zbv"
        for stage, actions in enumerate(schedule.actions):
            compute = [(a.kind, a.microbatch) for a in actions if a.kind.is_compute]
            kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
            expected = sorted((kind, mb) for kind in kinds for mb in range(m))
            assert sorted(compute) == expected, (schedule.name, stage)
            for mb in range(m):  # F before its backward before its W
                order = [compute.index((kind, mb)) for kind in kinds]
                assert order == sorted(order), (schedule.name, stage, mb)
            forwards = [mb for kind, mb in compute if kind is Kind.F]
            assert forwards == sorted(forwards)  # micro-batches enter a stage in order
            recv_act = [a.microbatch for a in actions if a.kind is Kind.RECV_ACT]
            send_grad = [a.microbatch for a in actions if a.kind is Kind.SEND_GRAD]
            assert recv_act == ([] if stage == 0 else forwards)
            assert len(send_grad) == (0 if stage == 0 else m)
            assert [a.kind for a in actions if a.kind is Kind.SEND_ACT] == [Kind.SEND_ACT] * (0 if stage == last else m)
            assert actions[-1] == Action(Kind.ALLREDUCE, stage)


def test_placement_follows_the_conventions_and_orders_merge_the_stage_lists() -> None:
    for schedule in SCHEDULES:
        p = schedule.num_groups
        if schedule.name == "zbv":
            assert schedule.placement == tuple([*range(p), *reversed(range(p))])
        else:
            assert schedule.placement == tuple(k % p for k in range(schedule.num_stages))
        for group, order in enumerate(schedule.orders):
            assert {schedule.group_of(a.stage) for a in order} == {group}
            for stage in range(schedule.num_stages):
                if schedule.group_of(stage) == group:
                    assert tuple(a for a in order if a.stage == stage) == schedule.actions[stage]
        assert sum(len(order) for order in schedule.orders) == sum(len(actions) for actions in schedule.actions)


def test_simulator_completes_with_random_costs_and_transfers() -> None:
    rng = random.Random(7)
    for schedule in SCHEDULES:
        costs = [cost(rng.uniform(0.5, 2), rng.uniform(1, 3), send=rng.uniform(0, 0.5), bi=None) for _ in range(schedule.num_stages)]
        if schedule.name == "zbv":
            costs = [replace(c, backward_input_ms=c.backward_ms / 2, backward_weight_ms=c.backward_ms / 2) for c in costs]
        result = simulate(schedule, costs)
        assert result.num_devices == schedule.num_groups
        for device, spans in result.timelines.items():  # one clock per group: no overlap
            compute = sorted(span for span in spans if span.kind in ("F", "B", "W"))
            assert all(a.end_ms <= b.start_ms + 1e-9 for a, b in zip(compute, compute[1:])), (schedule.name, device)
            assert {span.stage for span in compute} == {s for s in range(schedule.num_stages) if schedule.group_of(s) == device}


def test_a_misordered_merged_order_deadlocks_with_the_group_named() -> None:
    schedule = build_interleaved_schedule(2, 2, 2)
    order = list(schedule.orders[1])
    first_backward = next(i for i, a in enumerate(order) if a.kind is Kind.RECV_GRAD)
    # group 1 waits for a gradient before it has sent the forwards that lead to it
    order.insert(0, order.pop(first_backward))
    order.insert(1, order.pop(first_backward + 1))
    actions = tuple(tuple(a for a in (order if schedule.group_of(s) == 1 else schedule.orders[0]) if a.stage == s) for s in range(4))
    broken = replace(schedule, orders=(schedule.orders[0], tuple(order)), actions=actions)
    with pytest.raises(ScheduleDeadlock, match="device group 1 is stuck at 1RECV_B0 waiting for the gradient of micro-batch 0 from stage 2"):
        simulate(broken, [cost(1, 2)] * 4)


def test_orders_that_disagree_with_the_stage_lists_are_refused() -> None:
    schedule = build_zbv_schedule(2, 3)
    swapped = (schedule.orders[1], schedule.orders[0])
    with pytest.raises(DappleConfigError, match=r"schedule.orders\[0\]"):
        simulate(replace(schedule, orders=swapped), [cost(1, 2, bi=1, bw=1)] * 4)


@pytest.mark.parametrize("p,v,m", interleaved_cases())
def test_interleaved_unit_cost_step_is_megatrons_closed_form(p: int, v: int, m: int) -> None:
    """Chunks of 1/v of a stage (F = 1, B = 2 per whole stage), free transfers: the step
    is (M + (P-1)/v)(F+B), the pipeline filled v times faster than 1F1B's (M + P-1)(F+B)."""
    result = simulate(build_interleaved_schedule(p, v, m), [cost(1 / v, 2 / v)] * (p * v))
    assert result.latency_ms == pytest.approx((m + (p - 1) / v) * 3)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    one_f_one_b = simulate(build_schedule("dapple", p, m), [cost(1, 2)] * p)
    assert result.latency_ms < one_f_one_b.latency_ms


@pytest.mark.parametrize("p,m", zbv_cases())
def test_zbv_unit_cost_step_is_at_the_shortest_possible(p: int, m: int) -> None:
    """F = I = W = 1 per chunk, free transfers: every group computes 6M, and the last one
    cannot start before P-1 forwards. From M = P on ZB-V fills everything else (P = 2, 4)
    or all but one unit (P = 3)."""
    result = simulate(build_zbv_schedule(p, m), [cost(1, 2, bi=1, bw=1)] * (2 * p))
    bound = 6 * m + p - 1
    assert result.latency_ms >= bound
    if m >= p:
        assert result.latency_ms <= bound + (1 if p == 3 else 0)
    if m >= p and p != 3:
        assert result.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))


def test_zbv_bubble_approaches_zero_when_f_b_w_are_equal() -> None:
    fractions = [simulate(build_zbv_schedule(4, m), [cost(1, 2, bi=1, bw=1)] * 8).bubble_fraction for m in (8, 32, 128)]
    assert fractions == sorted(fractions, reverse=True)
    assert fractions[-1] < 0.005
    # against 1F1B with the same work per device (F = 2, B = 4 per whole stage)
    dapple = simulate(build_schedule("dapple", 4, 8), [cost(2, 4)] * 4).bubble_fraction
    assert fractions[0] < dapple / 4


def test_zbv_groups_hold_at_most_k_chunk_microbatches_and_reach_it() -> None:
    for p, m in zbv_cases():
        for k in range(2, 2 * p + 1):
            schedule = build_zbv_schedule(p, m, [k] * p)
            for group in range(p):
                held: set[tuple[int, int | None]] = set()
                peak = 0
                for action in schedule.group_actions(group):
                    if action.kind is Kind.F:
                        held.add((action.stage, action.microbatch))
                    elif action.kind is Kind.W:
                        held.discard((action.stage, action.microbatch))
                    peak = max(peak, len(held))
                assert peak <= k
                if group == 0:
                    assert peak == min(k, 2 * m)
            simulate(schedule, [cost(1, 2, bi=1, bw=1)] * (2 * p))  # completes with every cap


def test_interleaved_warmup_is_the_groups_forwards_before_its_first_backward() -> None:
    for schedule in SCHEDULES:
        if schedule.name != "interleaved":
            continue
        for group in range(schedule.num_groups):
            compute = [a for a in schedule.group_actions(group) if a.kind.is_compute]
            first_backward = next(i for i, a in enumerate(compute) if a.kind.is_backward)
            stage = schedule.placement.index(group)
            assert first_backward == schedule.warmups[stage]


def test_recompute_except_last_keeps_only_microbatches_no_other_forward_of_the_group_passes() -> None:
    """On a group, a stash that outlives a forward of another chunk is worth recomputing."""
    schedule = replace(build_interleaved_schedule(2, 2, 2), recompute=("except_last",) * 4)
    # group 1 runs 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1: only stage 3 runs a backward right after its forward
    assert [a.text for a in schedule.group_actions(1) if a.kind.is_compute] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"]
    assert schedule.recomputed(3) == frozenset()
    assert schedule.recomputed(1) == frozenset({0, 1})
    zbv = replace(build_zbv_schedule(2, 1), recompute=("except_last",) * 4)
    # group 0: 0F0 3F0 3I0 3W0 0I0 0W0: stage 0's own list is F0 I0 W0, but 3F0 ran in between
    assert [a.text for a in zbv.group_actions(0) if a.kind.is_compute] == ["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"]
    assert zbv.recomputed(0) == frozenset({0}) and zbv.recomputed(3) == frozenset()


def test_interleaved_refuses_a_microbatch_count_that_is_not_a_multiple_of_the_groups() -> None:
    with pytest.raises(DappleConfigError, match=r"plan.micro_batches: is 6.*Fix: use a multiple of 4 \(e.g. 8\)"):
        build_interleaved_schedule(4, 2, 6)
    with pytest.raises(DappleConfigError, match="use a multiple of 3"):
        chunked_plan("interleaved", 3, 2, 4).validate()


def test_plan_placement_checks() -> None:
    chunked_plan("interleaved", 2, 3, 4).validate()
    chunked_plan("zbv", 3, 2, 5).validate()
    v_shape = chunked_plan("zbv", 2, 2, 4)
    with pytest.raises(DappleConfigError, match="'interleaved' runs stage k on group k mod P"):
        replace(v_shape, schedule="interleaved").validate()
    looped = chunked_plan("interleaved", 2, 2, 4)
    with pytest.raises(DappleConfigError, match="'zbv' runs 2 chunks per group in a V"):
        replace(looped, schedule="zbv").validate()
    with pytest.raises(DappleConfigError, match="'zbv' runs 2 chunks per group in a V"):
        replace(chunked_plan("interleaved", 2, 3, 4), schedule="zbv").validate()
    with pytest.raises(DappleConfigError, match="plan.ooo: is on"):
        replace(looped, ooo=True).validate()
    uneven = replace(looped, stages=(replace(looped.stages[0], warmup=3), *looped.stages[1:]))
    with pytest.raises(DappleConfigError, match="differs between the stages of device group 0"):
        uneven.validate()
    with pytest.raises(DappleConfigError, match=r"warmup: is below 2"):
        replace(v_shape, stages=tuple(replace(s, warmup=1) for s in v_shape.stages)).validate()


def test_chunked_plans_round_trip_through_json_and_get_group_warmups() -> None:
    for plan in (chunked_plan("interleaved", 3, 2, 6), chunked_plan("zbv", 2, 2, 4, policy="PB")):
        filled = plan.with_warmups()
        for candidate in (plan, filled):
            assert plan_from_dict(candidate.to_dict()) == candidate
        assert plan_from_dict(filled.to_dict()).placement == plan.placement
    assert chunked_plan("interleaved", 3, 2, 6).with_warmups().warmups == (6, 5, 4, 6, 5, 4)
    assert chunked_plan("interleaved", 3, 2, 6, policy="PB").with_warmups().warmups == (8, 6, 4, 8, 6, 4)
    assert chunked_plan("zbv", 2, 2, 4).with_warmups().warmups == (4, 4, 4, 4)
    assert chunked_plan("zbv", 2, 2, 4, policy="PB").with_warmups().warmups == (6, 6, 6, 6)


def test_schedule_for_plan_builds_the_plans_schedule() -> None:
    plan = chunked_plan("interleaved", 2, 2, 4, policy="PB")
    built = schedule_for_plan(plan)
    assert built == build_interleaved_schedule(2, 2, 4, policy="PB")
    given = plan_from_dict({**plan.to_dict(), "stages": [{**s.to_dict(), "warmup": 3} for s in plan.stages]})
    assert schedule_for_plan(given).warmups == (3, 3, 3, 3)
    recomputing = replace(chunked_plan("zbv", 3, 2, 5), stages=tuple(replace(s, recompute="always") for s in chunked_plan("zbv", 3, 2, 5).stages))
    built = schedule_for_plan(recomputing)
    assert built.orders == build_zbv_schedule(3, 5).orders
    assert built.recompute == ("always",) * 6 and built.recomputed(4) == frozenset(range(5))


def test_same_group_boundaries_are_free_and_group_pairs_share_one_link_per_direction() -> None:
    send = 5.0
    v_shape = simulate(build_zbv_schedule(2, 4), [cost(1, 2, send=send, bi=1, bw=1)] * 4)
    assert set(v_shape.transfers) == {"0->1", "1->0"}  # no link for the 1 -> 2 hand-off on group 1
    spans = {(span.stage, span.kind, span.microbatch): span for span in v_shape.timelines[1]}
    for mb in range(4):  # stage 2's forward may start the moment stage 1's ends
        assert spans[(2, "F", mb)].start_ms >= spans[(1, "F", mb)].end_ms
    assert any(spans[(2, "F", mb)].start_ms == spans[(1, "F", mb)].end_ms for mb in range(4))
    looped = simulate(build_interleaved_schedule(2, 2, 4), [cost(1, 2, send=0.5)] * 4)
    assert set(looped.transfers) == {"0->1", "1->0"}
    down = looped.transfers["0->1"]  # activations of boundary 0 and 2, gradients of boundary 1
    assert {(span.kind, span.stage) for span in down} == {("act", 0), ("act", 2), ("grad", 2)}
    assert all(a.end_ms <= b.start_ms for a, b in zip(down, down[1:]))  # one transfer at a time
    assert len(down) == 3 * 4 and all(span.end_ms - span.start_ms == 0.5 for span in down)


def test_group_stash_walk_charges_each_chunk_its_own_bytes() -> None:
    """Group 0 of interleaved P=2, v=2, M=4 runs 0F0 0F1 2F0 2F1 2B0 0F2 2B1 0F3 0B0 ...:
    it holds 2a+2b after the warm-up, 4a after 0F3, so its peak is max(2a+2b, 4a)."""
    schedule = build_interleaved_schedule(2, 2, 4)
    compute = [a for a in schedule.group_actions(0) if a.kind.is_compute]
    assert [a.text for a in compute][:9] == ["0F0", "0F1", "2F0", "2F1", "2B0", "0F2", "2B1", "0F3", "0B0"]
    none = {0: frozenset(), 2: frozenset()}
    zero = {0: 0.0, 2: 0.0}
    assert group_stash_walk(compute, none, {0: 1.0, 2: 10.0}, zero, zero) == (22.0, 4)
    assert group_stash_walk(compute, none, {0: 10.0, 2: 1.0}, zero, zero) == (40.0, 4)
    # recomputed chunk 0 keeps only its 0.5-byte input until its backward replays it; the
    # peak is at 0B1 (after 2F2): inputs of 0F1..0F3, 2F2's stash and 0B1's replayed stash
    replayed = {0: frozenset(range(4)), 2: frozenset()}
    assert group_stash_walk(compute, replayed, {0: 10.0, 2: 1.0}, {0: 0.5, 2: 0.0}, zero) == (3 * 0.5 + 1.0 + 10.0, 4)


def test_stage_memory_reports_the_group_of_each_stage() -> None:
    from lightning_dapple.cluster import Cluster
    from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
    from lightning_dapple.simulate.plan_and_schedule import simulate_plan, stage_memory

    layers = tuple(LayerProfile(f"l{i}", forward_ms=1.0, backward_ms=2.0, output_bytes=8.0, param_bytes=100.0 * (i + 1), stash_bytes=1000.0) for i in range(4))
    profile = ModelProfile(micro_batch_size=8, layers=layers, name="four")
    cluster = Cluster(1, 2, name="two")
    plan = replace(chunked_plan("interleaved", 2, 2, 4), global_batch_size=32)
    memory, stashes, schedule, costs = stage_memory(plan, profile, cluster)
    weights = [c.param_bytes * (2.0 + cluster.optimizer_state_factor) for c in costs]
    # K = 4 chunk micro-batches on group 0 (stages 0, 2), 3 on group 1 (stages 1, 3), equal stashes
    assert stashes == [4 * costs[0].stash_bytes, 3 * costs[1].stash_bytes] * 2
    assert memory[0] == memory[2] == pytest.approx(weights[0] + weights[2] + stashes[0])
    assert memory[1] == memory[3] == pytest.approx(weights[1] + weights[3] + stashes[1])
    result = simulate_plan(plan, profile, cluster)
    assert sorted(result.timelines) == [0, 1] and [s.devices for s in result.stages] == [(0,), (1,), (0,), (1,)]
    assert result.latency_ms == pytest.approx((4 + 1 / 2) * 6)  # (M + (P-1)/v)(F+B) for two layers per group


def test_replicated_groups_share_one_timeline_and_sync_every_chunk() -> None:
    schedule = build_interleaved_schedule(2, 2, 4)
    devices = [(0, 1), (2, 3), (0, 1), (2, 3)]
    result = simulate(schedule, [cost(1, 2, ar=0.5)] * 4, devices)
    assert sorted(result.timelines) == [0, 1, 2, 3]
    assert result.timelines[0] == result.timelines[1] and result.timelines[2] == result.timelines[3]
    # chunk 2's gradients are final after 2B3, while group 0 still runs 0B2 and 0B3: its sync
    # hides behind them (link AR2); only chunk 0's, after the last backward, adds to the step
    exposed = [span for span in result.timelines[0] if span.kind == "AR"]
    assert [span.stage for span in exposed] == [0]
    last_backward_2 = max(span.end_ms for span in result.timelines[0] if span.stage == 2 and span.kind == "B")
    assert [(span.start_ms, span.end_ms) for span in result.transfers["AR2"]] == [(last_backward_2, last_backward_2 + 0.5)]
    assert last_backward_2 + 0.5 <= exposed[0].start_ms
    assert result.latency_ms == pytest.approx(simulate(schedule, [cost(1, 2)] * 4).latency_ms + 0.5)
    with pytest.raises(DappleConfigError, match="gives stage 2 devices \\[1, 0\\] but its device group runs on \\[0, 1\\]"):
        simulate(schedule, [cost(1, 2)] * 4, [(0, 1), (2, 3), (1, 0), (2, 3)])


def test_hand_given_k_that_would_deadlock_is_refused_before_anything_runs() -> None:
    """Group 0 running all 8 forwards first needs stage 1's third micro-batch, which group 1
    (K = 3) sends only after a backward that waits for group 0."""
    plan = chunked_plan("interleaved", 2, 2, 4)
    stuck = replace(plan, stages=tuple(replace(s, warmup=8 if s.devices == (0,) else 3) for s in plan.stages))
    with pytest.raises(DappleConfigError, match=r"plan.stages\[\].warmup: K per device group \[8, 3\] cannot run the 'interleaved' schedule.*P_A count \[4, 3\]"):
        schedule_for_plan(stuck)
    fine = replace(plan, stages=tuple(replace(s, warmup=7 if s.devices == (0,) else 3) for s in plan.stages))
    assert schedule_for_plan(fine).warmups == (7, 3, 7, 3)
