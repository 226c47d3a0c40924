"""Which sends a receive may wait for (schedule/settle.py): never a deadlock, and as much
synchronisation as torch's 1F1B where that is safe; on merged orders (several stages per
device group), each send waited as soon as its receiver is known to have it.

The deadlock check interprets every stage's action list with the executor's blocking rules:
sends and compute never block; a receive posts when reached and completes once its matching
send has run; after it completes, the receive waits for the sends ``settle_points`` names,
each done once its matching receive has been posted. Every replica runs its stage's list,
so one interpreter per stage is exact for the ordering question.
"""
from __future__ import annotations

import itertools

import pytest

from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.interleaved import build_interleaved_schedule
from lightning_dapple.schedule.settle import group_settle_points, settle_points
from lightning_dapple.schedule.zbv import build_zbv_schedule
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

MATCH = {Kind.SEND_ACT: (+1, Kind.RECV_ACT), Kind.SEND_GRAD: (-1, Kind.RECV_GRAD)}
SOURCE = {Kind.RECV_ACT: (-1, Kind.SEND_ACT), Kind.RECV_GRAD: (+1, Kind.SEND_GRAD)}


def _finishes(actions: list[list], settle: list[dict[int, frozenset]]) -> bool:
    """Whether every stage reaches the end of its list under the blocking rules."""
    done: set[tuple[int, Kind, int]] = set()  # (stage, kind, micro-batch) of executed sends
    posted: set[tuple[int, Kind, int]] = set()  # receives reached (posted)
    position = [0] * len(actions)
    received = [False] * len(actions)  # the receive at ``position`` has its data
    while True:
        moved = False
        for stage, own in enumerate(actions):
            while position[stage] < len(own):
                action = own[position[stage]]
                if action.kind in SOURCE:
                    posted.add((stage, action.kind, action.microbatch))
                    if not received[stage]:
                        offset, kind = SOURCE[action.kind]
                        if (stage + offset, kind, action.microbatch) not in done:
                            break
                        received[stage] = True
                    waits = settle[stage].get(position[stage], frozenset())
                    if any((stage + MATCH[k][0], MATCH[k][1], m) not in posted for k, m in waits):
                        break
                    received[stage] = False
                elif action.kind in MATCH:
                    done.add((stage, action.kind, action.microbatch))
                position[stage] += 1
                moved = True
        if all(p == len(own) for p, own in zip(position, actions)):
            return True
        if not moved:
            return False


def _plans() -> list:
    plans = []
    for stages, m, schedule, ooo in itertools.product((2, 3, 4), (1, 2, 3, 5, 8), ("dapple", "gpipe"), (False, True)):
        layers = [{"layers": [i, i + 1], "devices": [i]} for i in range(stages)]
        plans.append(plan_from_dict({"global_batch_size": 8 * m, "micro_batches": m, "schedule": schedule, "ooo": ooo, "stages": layers}))
    for policy in ("PA", "PB"):
        layers = [{"layers": [i, i + 1], "devices": [i]} for i in range(4)]
        plans.append(plan_from_dict({"global_batch_size": 48, "micro_batches": 6, "policy": policy, "stages": layers}))
    return plans


def test_every_schedule_finishes_with_its_settle_points() -> None:
    checked = 0
    for plan in _plans():
        schedule = schedule_for_plan(plan)
        settle = settle_points(schedule.actions)
        assert _finishes(schedule.actions, [{} for _ in schedule.actions]), plan  # the interpreter itself
        assert _finishes(schedule.actions, settle), plan
        for stage, points in enumerate(settle):
            own = schedule.actions[stage]
            for index, keys in points.items():
                assert own[index].kind in SOURCE
                sent_before = {(a.kind, a.microbatch) for a in own[:index]}
                assert keys <= sent_before, (plan, stage, index)  # only sends already issued
                peer = stage + SOURCE[own[index].kind][0]
                assert all(stage + MATCH[k][0] == peer for k, _ in keys)  # only to the peer received from
        checked += 1
    assert checked == len(_plans())


def _wait_for_everything(actions: list[list]) -> list[dict[int, frozenset]]:
    """A naive imitation of torch: wait for every earlier send at every receive."""
    out = []
    for own in actions:
        points, sent = {}, set()
        for index, action in enumerate(own):
            if action.kind in SOURCE and sent:
                points[index] = frozenset(sent)
            if action.kind in MATCH:
                sent.add((action.kind, action.microbatch))
        out.append(points)
    return out


def test_the_check_catches_a_deadlock_and_settle_points_avoid_it() -> None:
    """Two stages that both send twice before receiving: the original lists finish; waiting
    for every earlier send deadlocks (each side waits for a receive the other posts only
    after its own wait); the settle points wait only for what the peer has already posted."""
    s0 = [Action(Kind.SEND_ACT, 0, 0), Action(Kind.SEND_ACT, 0, 1), Action(Kind.RECV_GRAD, 0, 0), Action(Kind.RECV_GRAD, 0, 1)]
    s1 = [Action(Kind.SEND_GRAD, 1, 0), Action(Kind.SEND_GRAD, 1, 1), Action(Kind.RECV_ACT, 1, 0), Action(Kind.RECV_ACT, 1, 1)]
    actions = [s0, s1]
    assert _finishes(actions, [{}, {}])
    assert not _finishes(actions, _wait_for_everything(actions))
    settle = settle_points(actions)
    assert settle[0][2] == frozenset({(Kind.SEND_ACT, 0)})
    assert _finishes(actions, settle)


def test_two_stage_1f1b_waits_like_torch() -> None:
    """Stage 0 waits at each gradient receive for every activation already sent (torch's
    batched send+receive wait); stage 1 at each activation receive for its earlier gradients."""
    plan = plan_from_dict(
        {"global_batch_size": 16, "micro_batches": 4, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 2], "devices": [1]}]}
    )
    schedule = schedule_for_plan(plan)
    settle = settle_points(schedule.actions)
    first = {a.microbatch: settle[0].get(i) for i, a in enumerate(schedule.actions[0]) if a.kind is Kind.RECV_GRAD}
    for j, keys in first.items():
        sent = {m for m in range(4) if m <= j + 1}  # warm-up K_0 = 2: A_0..A_{j+1} are out
        assert keys == frozenset((Kind.SEND_ACT, m) for m in sent), (j, keys)
    last = {a.microbatch: settle[1].get(i) for i, a in enumerate(schedule.actions[1]) if a.kind is Kind.RECV_ACT}
    assert last[0] is None
    for j in range(1, 4):
        assert last[j] == frozenset((Kind.SEND_GRAD, m) for m in range(j)), (j, last[j])


@pytest.mark.parametrize("replicas", [(2, 1), (1, 2), (3, 1)])
def test_split_concat_plans_share_their_stage_lists(replicas: tuple[int, int]) -> None:
    """Replicated stages run one list per stage, so their settle points are the stage's."""
    devices = iter(range(sum(replicas)))
    stages = [{"layers": [i, i + 1], "devices": [next(devices) for _ in range(r)]} for i, r in enumerate(replicas)]
    plan = plan_from_dict({"global_batch_size": 24, "micro_batches": 4, "stages": stages})
    schedule = schedule_for_plan(plan)
    assert _finishes(schedule.actions, settle_points(schedule.actions))


def test_gradient_buckets_leave_the_executors_lists_and_settle_points_unchanged() -> None:
    """The simulator builds ooo lists with the profile's gradient buckets, the executor
    without a profile: only the ALLREDUCE markers differ, so both run the same compute and
    transfers and wait for the same sends."""
    from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, float(10 * (i + 1)), 1e3) for i in range(6))
    profile = ModelProfile(4, layers)
    plan = plan_from_dict({"global_batch_size": 16, "micro_batches": 4, "ooo": True, "stages": [
        {"layers": [0, 4], "devices": [0, 1]}, {"layers": [4, 6], "devices": [2]}]})
    executor = schedule_for_plan(plan)
    simulator = schedule_for_plan(plan, profile, bucket_bytes=25)
    markers = [[a for a in stage if a.kind is Kind.ALLREDUCE] for stage in simulator.actions]
    assert len(markers[0]) > 1 and len(markers[1]) == 1  # buckets only on the replicated stage
    for ours, theirs in zip(executor.actions, simulator.actions):
        assert [a for a in ours if a.kind is not Kind.ALLREDUCE] == [a for a in theirs if a.kind is not Kind.ALLREDUCE]
    assert settle_points([list(s) for s in executor.actions]) == settle_points([list(s) for s in simulator.actions])


# -- merged orders (several stages per device group): group_settle_points ---------------------


def _merged(schedule: Schedule) -> tuple[list[list[Action]], dict[tuple, tuple[int, int]]]:
    orders = [list(schedule.group_actions(g)) for g in range(schedule.num_groups)]
    where = {(a.kind, a.stage, a.microbatch): (g, i) for g, order in enumerate(orders) for i, a in enumerate(order)}
    return orders, where


def _crossing(schedule: Schedule, action: Action) -> bool:
    table = MATCH if action.kind in MATCH else SOURCE if action.kind in SOURCE else None
    if table is None:
        return False
    peer = action.stage + table[action.kind][0]
    return 0 <= peer < schedule.num_stages and schedule.group_of(peer) != schedule.group_of(action.stage)


def _merged_finishes(schedule: Schedule, settle: list[dict[int, frozenset]]) -> bool:
    """The executor's blocking rules on merged orders: a receive across groups completes once
    its send ran; then it waits for the sends ``settle`` names, each only once its matching
    receive has *completed* (the claim: such a wait needs nothing more from anyone).
    Everything else (compute, sends, hand-offs between a group's own stages) never blocks."""
    orders, where = _merged(schedule)
    position = [0] * len(orders)
    while True:
        moved = False
        for g, order in enumerate(orders):
            while position[g] < len(order):
                action = order[position[g]]
                if action.kind in SOURCE and _crossing(schedule, action):
                    offset, kind = SOURCE[action.kind]
                    sender, at = where[(kind, action.stage + offset, action.microbatch)]
                    if position[sender] <= at:
                        break
                    due = settle[g].get(position[g], frozenset())
                    receivers = [where[(MATCH[k][1], s + MATCH[k][0], m)] for k, s, m in due]
                    assert all(position[h] > i for h, i in receivers), (schedule.name, g, action, due)
                position[g] += 1
                moved = True
        if all(p == len(order) for p, order in zip(position, orders)):
            return True
        if not moved:
            return False


def _first_point_after_receipt(schedule: Schedule, orders: list[list[Action]], where: dict, g: int, s: int) -> int | None:
    """By brute force over the happens-before graph (program order within a group, send ->
    matching receive across groups): the first blocking receive of group ``g`` after its
    send at ``s`` that happens after that send's matching receive."""
    send = orders[g][s]
    start = where[(MATCH[send.kind][1], send.stage + MATCH[send.kind][0], send.microbatch)]
    reached, frontier = {start}, [start]
    while frontier:
        h, i = frontier.pop()
        nxt = [(h, i + 1)] if i + 1 < len(orders[h]) else []
        action = orders[h][i]
        if action.kind in MATCH and _crossing(schedule, action):
            nxt.append(where[(MATCH[action.kind][1], action.stage + MATCH[action.kind][0], action.microbatch)])
        for node in nxt:
            if node not in reached:
                reached.add(node)
                frontier.append(node)
    blocking = [i for i, a in enumerate(orders[g]) if i > s and a.kind in SOURCE and _crossing(schedule, a)]
    return next((i for i in blocking if (g, i) in reached), None)


def _chunked_schedules() -> list[Schedule]:
    built = [build_zbv_schedule(p, m) for p, m in ((2, 4), (2, 8), (3, 6), (4, 8))]
    built += [build_interleaved_schedule(p, v, m) for p, v, m in ((2, 2, 4), (2, 3, 4), (4, 2, 8), (3, 2, 6))]
    return built


@pytest.mark.parametrize("schedule", _chunked_schedules(), ids=lambda s: f"{s.name}-{s.num_groups}x{s.num_stages // s.num_groups}-M{s.micro_batches}")
def test_merged_orders_settle_each_send_once_its_receiver_is_known_to_have_it(schedule: Schedule) -> None:
    """Every send of a ZB-V or interleaved merged order is waited at exactly the first point
    after which its receive is known complete (brute force over the happens-before graph);
    only sends after which no such point comes are left to the end of the step; the orders
    finish with those waits; and a group never keeps more than half its sends pending,
    where without them it kept all of them to the end."""
    settle = group_settle_points(schedule)
    orders, where = _merged(schedule)
    assert _merged_finishes(schedule, [{} for _ in orders]) and _merged_finishes(schedule, settle)
    for g, order in enumerate(orders):
        found: dict[tuple, int] = {key: i for i, keys in settle[g].items() for key in keys}
        assert sum(len(keys) for keys in settle[g].values()) == len(found)  # each send once
        sends = [(i, a) for i, a in enumerate(order) if a.kind in MATCH and _crossing(schedule, a)]
        pending = peak = 0
        for i, action in enumerate(order):
            pending -= len(settle[g].get(i, ()))
            if action.kind in MATCH and _crossing(schedule, action):
                pending += 1
            peak = max(peak, pending)
        left = 0
        for s, send in sends:
            expected = _first_point_after_receipt(schedule, orders, where, g, s)
            assert found.get((send.kind, send.stage, send.microbatch)) == expected, (g, send, expected)
            left += expected is None
        assert left <= len(sends) // 4 and peak <= len(sends) // 2, (g, left, peak, len(sends))


def test_a_hand_off_inside_a_group_is_neither_waited_nor_a_point() -> None:
    """ZB-V's turn (stage P-1 to P on one group) is a hand-off in process."""
    schedule = build_zbv_schedule(2, 4)
    settle = group_settle_points(schedule)
    turn = {(Kind.SEND_ACT, 1), (Kind.SEND_GRAD, 2)}
    for g, points in enumerate(settle):
        order = schedule.group_actions(g)
        for index, keys in points.items():
            assert order[index].kind in SOURCE and _crossing(schedule, order[index])
            assert not {(k, s) for k, s, _ in keys} & turn


def test_on_one_stage_per_group_the_merged_rule_waits_no_earlier_than_the_plain_one() -> None:
    """Plain schedules read as groups of one stage: every send the merged rule waits for at a
    receive, the plain rule (which also counts receives the peer will post before it blocks
    again) waits for there or before."""
    for plan in _plans():
        schedule = schedule_for_plan(plan)
        plain = settle_points([list(a) for a in schedule.actions])
        merged = group_settle_points(schedule)
        assert _finishes(schedule.actions, [{i: frozenset((k, m) for k, _, m in keys) for i, keys in p.items()} for p in merged])
        for stage, points in enumerate(merged):
            first = {}
            for index in sorted(plain[stage]):
                for key in plain[stage][index]:
                    first.setdefault(key, index)
            for index, keys in points.items():
                assert all(first[(k, m)] <= index for k, _, m in keys), (plan, stage, index)
