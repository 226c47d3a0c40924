"""Which sends a receive may wait for (schedule/settle.py): never a deadlock, and as much
synchronisation as torch's 1F1B where that is safe.

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
from lightning_dapple.schedule.actions import Action, Kind
from lightning_dapple.simulate.plans import schedule_for_plan
from lightning_dapple.schedule.settle import settle_points

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
