"""Ranks holding several stages (chunks) train exactly as one process does.

Float64, Adam, global-norm clipping active, 3 optimizer steps, then one eval pass; every
case is compared with a plain single-process run on the same batches, to 1e-10. The cases
run inside one spawned group of 4 gloo ranks: interleaved placement (stage k on group
k mod 2) and the V placement (stages 0, 1 down and 2, 3 back up, stage 1 -> 2 a hand-off
inside the process), on 2 groups of 1 rank and 2 groups of 2 replicas, with recomputation
never and always, under a breadth-first schedule written by hand (full backward, and split
into I and W), and under the builders' ``interleaved`` and ``zbv`` schedules. The model
passes a tuple across a boundary (over the wire under interleaving, in process under V).
Each rank's most chunk micro-batches in flight is the memory model's
(``group_stash_walk`` over its group's merged order). A tied embedding and head (on two
groups, or both on one under V), a failure inside one chunk, and the set-up checks (merged
orders, stream orders, separate tensors for one tie) and the nccl wire's communicator per
stream have tests of their own, and so do sends waited before the end of the step
(``settle_worker``).
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import chunked_worker as cw
from dist_harness import run_ranks
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import PlanGroups
from lightning_dapple.execute.transfer.links import check_stream_orders
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.tied import build_tied_sync
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.ties import TiedParameter
from lightning_dapple.schedule.actions import Action, Kind, group_stash_walk
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

CUTS = [[0, 2], [2, 3], [3, 5], [5, 8]]
PLACEMENTS = {"interleaved": [0, 1, 0, 1], "zbv": [0, 1, 1, 0]}
GROUPS = {"straight": [[0], [1]], "2x2": [[0, 1], [2, 3]]}


def plan_data(schedule: str, layout: str, recompute: str = "never", micro_batches: int = 2) -> dict:
    groups = GROUPS[layout]
    stages = [{"layers": cut, "devices": groups[group], "recompute": recompute} for cut, group in zip(CUTS, PLACEMENTS[schedule])]
    return {"global_batch_size": cw.ROWS, "micro_batches": micro_batches, "schedule": schedule, "stages": stages}


def _expected_in_flight(plan_dict: dict, kind: str, stages: tuple[int, ...]) -> int:
    """The most chunk micro-batches the memory model holds at once on these stages' group
    (``group_stash_walk`` over the merged order): what the executor's ledger must count."""
    plan = plan_from_dict(plan_dict)
    schedule = cw.schedule_of(plan, kind)
    compute = [a for a in schedule.group_actions(plan.placement[stages[0]]) if a.kind.is_compute]
    ones = {stage: 1.0 for stage in stages}
    return group_stash_walk(compute, {stage: schedule.recomputed(stage) for stage in stages}, ones, ones, ones)[1]


def _check(results: dict, cases: list, names: list[str]) -> None:
    assert "__errors__" not in results, results.get("__errors__")
    for index, name in enumerate(names):
        per_rank = [results[rank][index] for rank in results if results[rank][index] is not None]
        assert per_rank, name
        for res in per_rank:
            expected = _expected_in_flight(cases[index][0], cases[index][1], res["stages"])
            assert res["peak_in_flight"] == expected, (name, res, expected)
            assert res["param_diff"] < 1e-10, (name, res)
            assert res["loss_diff"] < 1e-10, (name, res)
            assert res["eval_diff"] < 1e-10, (name, res)
            recompute = cases[index][0]["stages"][0].get("recompute", "never")
            # each of a rank's chunks replays every one of its M micro-batches in the last step
            replays = len(res["stages"]) * cases[index][0]["micro_batches"]
            assert res["recomputed"] == (replays if recompute == "always" else 0), (name, res)


@pytest.mark.timeout(600)
def test_hand_written_chunked_schedules_match_single_device() -> None:
    cases, names = [], []
    for schedule in PLACEMENTS:
        for layout in GROUPS:
            for recompute in ("never", "always"):
                for kind in ("looped", "looped-split"):
                    micro_batches = 2 if kind == "looped" else 4
                    # receives posted one ahead in the merged order, and when due
                    cases.append((plan_data(schedule, layout, recompute, micro_batches), kind, {"post_ahead": recompute == "never"}))
                    names.append(f"{schedule}/{layout}/{recompute}/{kind}")
    results = run_ranks(cw.run_cases, 4, cases, timeout_s=500)
    _check(results, cases, names)


@pytest.mark.timeout(600)
def test_interleaved_and_zbv_schedules_match_single_device() -> None:
    """The builders' schedules (``schedule_for_plan``): interleaved 1F1B with 2 chunks per
    group and ZB-V (its turn a hand-off in process, B split into I and W) at M = 4, and on
    six stages (3 chunks per group interleaved; ZB-V on 3 groups)."""
    cases, names = [], []
    for schedule in PLACEMENTS:
        for layout in GROUPS:
            for recompute in ("never", "always"):
                cases.append((plan_data(schedule, layout, recompute, micro_batches=4), "built", {"post_ahead": recompute == "never"}))
                names.append(f"{schedule}/{layout}/{recompute}")
        # the staged wire's code path (host buffers; gloo with CUDA tensors) with tagged streams
        cases.append((plan_data(schedule, "2x2", "never", micro_batches=4), "built", {"wire": "staged", "post_ahead": True}))
        names.append(f"{schedule}/2x2/never/staged")
    # six stages: interleaved with 3 chunks on 2 groups, ZB-V on 3 groups
    six = [[0, 1], [1, 2], [2, 3], [3, 5], [5, 6], [6, 8]]
    for schedule, placement in (("interleaved", [0, 1, 0, 1, 0, 1]), ("zbv", [0, 1, 2, 2, 1, 0])):
        stages = [{"layers": cut, "devices": [group]} for cut, group in zip(six, placement)]
        cases.append(({"global_batch_size": cw.ROWS, "micro_batches": 4, "schedule": schedule, "stages": stages}, "built", {"post_ahead": True}))
        names.append(f"{schedule}/six stages")
    results = run_ranks(cw.run_cases, 4, cases, timeout_s=500)
    _check(results, cases, names)


@pytest.mark.timeout(400)
def test_sends_waited_once_their_receiver_has_them_train_the_same_with_fewer_pending() -> None:
    """Interleaved and ZB-V, on 2 groups of 1 rank and of 2 replicas: with each send waited
    at the first receive of the merged order after which its receiver is known to have it
    (``schedule.settle.group_settle_points``), training equals one process in float64, as
    with every send left to the end of the step (``settle_sends=False``); every rank waits
    some sends before the end, and keeps fewer pending at once."""
    import settle_worker

    cases, names = [], []
    for schedule in PLACEMENTS:
        for layout in GROUPS:
            for settle in (True, False):
                cases.append((plan_data(schedule, layout, micro_batches=4), {"settle_sends": settle}))
                names.append(f"{schedule}/{layout}/{'settle' if settle else 'at the end'}")
    results = run_ranks(settle_worker.run_cases, 4, cases, timeout_s=300)
    assert "__errors__" not in results, results.get("__errors__")
    for index in range(0, len(cases), 2):
        for rank in results:
            settled, at_end = results[rank][index], results[rank][index + 1]
            if settled is None:
                continue
            for res in (settled, at_end):
                assert res["param_diff"] < 1e-10 and res["loss_diff"] < 1e-10, (names[index], rank, res)
            assert at_end["settled"] == 0 and settled["settled"] > 0, (names[index], rank, settled)
            assert settled["peak_pending"] < at_end["peak_pending"], (names[index], rank, settled, at_end)


@pytest.mark.timeout(400)
def test_chunked_plans_over_the_nccl_wire_match_single_device() -> None:
    """The nccl wire (forced; over gloo with CPU tensors, untagged: a communicator matches by
    order alone, as NCCL's do) with a communicator per stream: interleaved and ZB-V on 2
    groups of 2 replicas, and 8 one-layer stages on 4 ranks, where rank pairs carry up to
    4 streams."""
    cases, names = [], []
    for schedule in PLACEMENTS:
        cases.append((plan_data(schedule, "2x2", "never", micro_batches=4), "built", {"wire": "nccl"}))
        names.append(f"{schedule}/2x2/nccl")
    for schedule, placement in (("interleaved", [k % 4 for k in range(8)]), ("zbv", [0, 1, 2, 3, 3, 2, 1, 0])):
        stages = [{"layers": [k, k + 1], "devices": [group]} for k, group in enumerate(placement)]
        cases.append(({"global_batch_size": cw.ROWS, "micro_batches": 4, "schedule": schedule, "stages": stages}, "built", {"wire": "nccl"}))
        names.append(f"{schedule}/8 stages on 4 ranks/nccl")
    results = run_ranks(cw.run_cases, 4, cases, timeout_s=300)
    _check(results, cases, names)


@pytest.mark.timeout(400)
def test_a_tied_embedding_and_head_train_like_one_process_on_other_groups_or_the_same() -> None:
    """The tied GPT's embedding (stage 0) and head (stage 3): under interleaving on groups 0
    and 1 (one summed gradient over the ranks of both), under V both on group 0 (one shared
    parameter there, summed over that group's replicas); counted once in clipping."""
    gpt = [[0, 1], [1, 2], [2, 4], [4, 5]]
    placements = {"interleaved": [0, 1, 0, 1], "zbv": [0, 1, 1, 0]}
    cases = [
        {"global_batch_size": 12, "micro_batches": 4, "schedule": schedule, "stages": [{"layers": cut, "devices": GROUPS[layout][g]} for cut, g in zip(gpt, placement)]}
        for schedule, placement in placements.items()
        for layout in GROUPS
    ]
    results = run_ranks(cw.run_tied_cases, 4, cases, timeout_s=300)
    assert "__errors__" not in results, results.get("__errors__")
    for index, case in enumerate(cases):
        holding = {rank for s in (0, 3) for rank in case["stages"][s]["devices"]}
        per_rank = {rank: results[rank][index] for rank in results if results[rank][index] is not None}
        assert len(per_rank) == sum(len(stage["devices"]) for stage in case["stages"]) // 2, case
        for rank, res in per_rank.items():
            assert res["param_diff"] < 1e-10, (case, rank, res)
            assert res["tied_copies"] == (1 if rank in holding else 0), (case, rank, res)  # one copy, even for two stages


@pytest.mark.timeout(240)
def test_a_failure_in_one_chunk_ends_every_rank_with_the_action_named(capfd: pytest.CaptureFixture[str]) -> None:
    """Stage 2 (on rank 0 with stage 0) fails in the forward of micro-batch 1. Rank 0 names
    the action; rank 1, blocked on stage 2's activation, stops with that message and exits
    (``execute/failure.py``), within the failure channel's bound."""
    started = time.monotonic()
    results = run_ranks(cw.run_failure, 2, plan_data("interleaved", "straight"), "looped", timeout_s=200)
    elapsed = time.monotonic() - started
    failing = results[0]
    assert failing["type"] == "RuntimeError", failing
    assert failing["message"] == "in action 2F1: forward failed", failing
    assert 1 not in results  # the peer was ended by its failure channel, not by a transfer error of its own
    said = capfd.readouterr().err
    assert "rank 0 raised RuntimeError: in action 2F1: forward failed (seen on rank 1" in said, said
    assert elapsed < 120, elapsed


# --------------------------------------------------------------------------- set-up checks


def _runner_on_rank_0(data: dict, schedule=None, **options):
    """Rank 0's runner of a 2-rank plan in a 1-process group: set-up only (no transfer)."""
    dist.init_process_group("gloo", rank=0, world_size=1)
    plan = plan_from_dict(data)
    model = cw.make_model()
    local = [model[i] for stage in plan.stages_of_rank(0) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
    failure = FailureChannel(0, timeout_s=30)
    try:
        return StageRunner.for_plan(
            plan, 0, local, torch.device("cpu"), failure, ties=(), groups=PlanGroups({}, None),
            schedule=schedule if schedule is not None else cw.looped_schedule(plan), **options,
        )
    finally:
        failure.close()


def test_a_rank_runs_the_union_of_its_chunks_each_parameter_once() -> None:
    runner = _runner_on_rank_0(plan_data("zbv", "straight"))
    model = cw.make_model()
    expected = [p.shape for i in (0, 1, 5, 6, 7) for p in model[i].parameters()]
    assert [p.shape for p in runner.parameters] == expected
    assert runner.stages == (0, 3) and runner.is_first and runner.is_last


def test_a_merged_order_that_breaks_a_stage_list_is_refused() -> None:
    plan = plan_from_dict(plan_data("interleaved", "straight"))
    schedule = cw.looped_schedule(plan)
    order = list(schedule.orders[0])
    first_f = next(i for i, a in enumerate(order) if a.kind is Kind.F)
    order[first_f], order[first_f + 2] = order[first_f + 2], order[first_f]  # 0F1 before 0F0
    broken = replace(schedule, orders=(tuple(order), schedule.orders[1]))
    with pytest.raises(DappleConfigError, match="merged order of device group 0 runs 0F1 where stage 0's own list has 0F0"):
        _runner_on_rank_0(plan_data("interleaved", "straight"), schedule=broken)


def test_a_stream_whose_ends_take_micro_batches_in_different_orders_is_refused() -> None:
    """Stage 1 takes activation 1 of boundary 0 before activation 0, which rank 0 sends
    first: the receive of micro-batch 0 would get micro-batch 1's rows."""
    plan = plan_from_dict(plan_data("interleaved", "straight"))
    schedule = cw.looped_schedule(plan)
    check_stream_orders(plan, schedule)
    first, second = Action(Kind.RECV_ACT, 1, 0), Action(Kind.RECV_ACT, 1, 1)
    swap = {first: second, second: first}
    stage_1 = tuple(swap.get(a, a) for a in schedule.actions[1])
    order_1 = tuple(swap.get(a, a) for a in schedule.orders[1])
    crossed = replace(schedule, actions=(schedule.actions[0], stage_1, *schedule.actions[2:]), orders=(schedule.orders[0], order_1))
    with pytest.raises(DappleConfigError, match=r"rank 0 sends rank 1 the activations of boundary 0 in the order \[0, 1\] but rank 1 takes them in the order \[1, 0\]"):
        check_stream_orders(plan, crossed)


def test_the_built_chunked_schedules_keep_every_stream_in_one_order() -> None:
    """Each boundary and direction between two ranks: sent and taken in one micro-batch order,
    for the builders' interleaved and V schedules over several shapes (what tagged streams need)."""
    checked = 0
    for schedule, placement_of in (("interleaved", lambda g: [k % g for k in range(2 * g)]), ("zbv", lambda g: [k if k < g else 2 * g - 1 - k for k in range(2 * g)])):
        for groups in (2, 3, 4):
            for micro_batches in range(groups, 3 * groups + 1):
                for replicas in (1, 2):
                    if schedule == "interleaved" and micro_batches % groups:
                        continue  # interleaving runs micro-batches in rounds of one per group
                    stages = [{"layers": [k, k + 1], "devices": list(range(g * replicas, (g + 1) * replicas))} for k, g in enumerate(placement_of(groups))]
                    data = {"global_batch_size": 4 * micro_batches, "micro_batches": micro_batches, "schedule": schedule, "stages": stages}
                    plan = plan_from_dict(data)
                    check_stream_orders(plan, schedule_for_plan(plan))
                    checked += 1
    assert checked > 40


def test_chunks_on_one_rank_holding_separate_tensors_for_a_tie_are_refused() -> None:
    """Under V a tied embedding (layer 0) and head (layer 7) are both on rank 0: one
    ``nn.Parameter`` there sums both uses; two separate tensors would each sum only their own."""
    plan = plan_from_dict(plan_data("zbv", "straight"))
    tie = (TiedParameter(((0, "weight"), (7, "weight")), 8),)
    layers = [nn.Linear(2, 2, bias=False) for _ in range(8)]
    held = [i for stage in plan.stages_of_rank(0) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
    local = [layers[i] for i in held]
    no_collective = None  # set-up only: neither call reaches the failure channel
    with pytest.raises(DappleConfigError, match=r"separate tensors for the tied parameter 'weight' in layers \[0, 7\] on rank 0"):
        build_tied_sync(plan, tie, 0, local, {(0,): None}, no_collective)
    layers[7].weight = layers[0].weight  # tied as the model ties it: one parameter, one copy here
    sync = build_tied_sync(plan, tie, 0, local, {(0,): None}, no_collective)
    assert sync is not None and sync.params == [layers[0].weight] and sync.copies == {id(layers[0].weight): 1}
