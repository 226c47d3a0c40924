"""No schedule can deadlock the ``nccl`` wire, and no receive waits behind unrelated sends.

NCCL runs a communicator's operations in issue order on one stream and matches a pair's
sends and receives by that order alone. The ``nccl`` wire gives every link (two ranks of
adjacent stages that share rows, DAPPLE 5.2.2) one communicator per direction
(``execute/transfer/wires.py``, ``execute/transfer/links.py``), so each communicator carries one sender's
messages to one receiver, and the rule becomes: per communicator, the sender issues its
transfers in the order the receiver issues the receives.

* Unit level, from the schedules alone: for every schedule the package builds (dapple with
  P_A and P_B warm-ups, gpipe; with and without out-of-order backprop) on several stage
  widths, micro-batch counts and batch sizes, both ends of every communicator issue the
  same micro-batches in the same order; a schedule that breaks the rule is caught.
* Real processes over gloo, on the ``nccl`` wire's code path: every rank runs its action
  list's sends and receives through the transport (settling sends as the executor does),
  activations and gradients crossing on every link, with the layout changing between
  schedules (filler, header and structure messages); every case completes within a bound,
  every received row is the one its sender sent, and every process group the wire uses
  carries one direction between one pair of ranks.

The same crossing traffic under real NCCL (one GPU per rank) is in
``tests/test_cuda_transport.py``.
"""
from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch

from dist_harness import run_ranks
from lightning_dapple.execute.transfer.keys import Direction
from lightning_dapple.execute.transfer.links import link_orders, mismatched_links, plan_links
from lightning_dapple.execute.slicing import overlap, row_range
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.schedule.actions import Kind
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

# devices of each stage; ranks are numbered stage by stage
SHAPES = {
    "1:1": [[0], [1]],
    "3x1": [[0], [1], [2]],
    "1:3": [[0], [1, 2, 3]],
    "3:2": [[0, 1, 2], [3, 4]],
    "2:1:2": [[0, 1], [2], [3, 4]],
}
# (schedule, warm-up policy, out-of-order backprop)
SCHEDULES = [(name, policy, ooo) for name, policy in (("dapple", "PA"), ("dapple", "PB"), ("gpipe", "PA")) for ooo in (False, True)]
MICRO_BATCHES = 4
BATCH = 20  # 5 rows per micro-batch: uneven splits over 2 and 3 replicas


def make_plan(shape: str, schedule: str, policy: str, ooo: bool, micro_batches: int = MICRO_BATCHES, batch: int = BATCH) -> Any:
    stages = [{"layers": [2 * index, 2 * index + 2], "devices": devices} for index, devices in enumerate(SHAPES[shape])]
    data = {"global_batch_size": batch, "micro_batches": micro_batches, "stages": stages, "schedule": schedule, "policy": policy, "ooo": ooo}
    return plan_from_dict(data)


# --------------------------------------------------------------------------- unit level


@pytest.mark.parametrize("shape", list(SHAPES))
def test_both_ends_of_every_communicator_issue_the_same_order_in_every_schedule(shape: str) -> None:
    for schedule, policy, ooo in SCHEDULES:
        for micro_batches, batch in ((MICRO_BATCHES, BATCH), (3, 12), (6, 42), (8, 8 * 7)):
            plan = make_plan(shape, schedule, policy, ooo, micro_batches, batch)
            actions = schedule_for_plan(plan).actions
            orders = link_orders(plan, actions, batch)
            case = (shape, schedule, policy, ooo, micro_batches, batch)
            assert not mismatched_links(orders), (case, mismatched_links(orders))
            links = set(plan_links(plan))
            for (direction, sender, receiver), (sent, _) in orders.items():
                # a communicator per link and direction carries each micro-batch at most once
                link = (sender, receiver) if direction is Direction.ACTIVATION else (receiver, sender)
                assert link in links, (case, direction, sender, receiver)
                assert sorted(sent) == sorted(set(sent)), (case, sent)
            # activations and gradients cross on every link that carries rows
            forward = {(s, r) for (d, s, r) in orders if d is Direction.ACTIVATION}
            backward = {(r, s) for (d, s, r) in orders if d is Direction.GRADIENT}
            assert forward == backward and forward <= links, case


def test_a_schedule_whose_ends_disagree_is_caught() -> None:
    """Stage 1 receiving activation 1 before activation 0 (while stage 0 sends 0 first) is
    what would make a communicator's first send meet the wrong receive."""
    plan = make_plan("1:3", "dapple", "PA", False)
    actions = [list(stage) for stage in schedule_for_plan(plan).actions]
    first, second = (index for index, action in enumerate(actions[1]) if action.kind is Kind.RECV_ACT and action.microbatch in (0, 1))
    actions[1][first], actions[1][second] = actions[1][second], actions[1][first]
    bad = mismatched_links(link_orders(plan, actions, BATCH))
    assert {channel for channel, _, _ in bad} == {(Direction.ACTIVATION, 0, r) for r in (1, 2, 3)}, bad
    assert all(sent[:2] == [0, 1] and received[:2] == [1, 0] for _, sent, received in bad), bad


def test_links_are_every_pair_that_can_share_rows_and_no_more() -> None:
    """``plan_links`` keeps a pair of replicas exactly when some micro-batch size gives them
    common rows: at most r1 + r2 - 1 links per boundary, not r1 * r2."""
    for up in range(1, 6):
        for down in range(1, 6):
            plan = plan_from_dict(
                {
                    "global_batch_size": 60,
                    "micro_batches": 1,
                    "stages": [{"layers": [0, 1], "devices": list(range(up))}, {"layers": [1, 2], "devices": list(range(up, up + down))}],
                }
            )
            shared = {
                (i, up + j)
                for rows in range(1, 121)
                for i in range(up)
                for j in range(down)
                if overlap(row_range(rows, up, i), row_range(rows, down, j)) is not None
            }
            links = set(plan_links(plan))
            assert links == shared, (up, down, sorted(links ^ shared))
            assert len(links) <= up + down - 1, (up, down, len(links))


# --------------------------------------------------------------------------- real processes


def _values(stage: int, mb: int, rows: tuple[int, int], layout: int, sign: float) -> torch.Tensor:
    """What stage ``stage`` sends for micro-batch ``mb`` (rows of the global batch): every
    entry names its stage, micro-batch and row; ``layout`` picks dtype and shape."""
    base = torch.arange(rows[0], rows[1], dtype=torch.float64)[:, None] * 1000 + mb * 10 + stage
    if layout % 2 == 0:
        return (sign * (base + torch.arange(3, dtype=torch.float64))).requires_grad_(True)
    return (sign * (base[:, :, None] + torch.arange(4, dtype=torch.float64).reshape(2, 2))).float().requires_grad_(True)


def _peers(plan: Any, stage: int, mb: int, batch: int) -> list[Any]:
    from lightning_dapple.execute.slicing import slice_rows
    from lightning_dapple.execute.transfer.transport import Peer

    devices = plan.stages[stage].devices
    return [Peer(rank, slice_rows(batch, plan.micro_batches, mb, len(devices), index)) for index, rank in enumerate(devices)]


def run_action_list(rank: int, plan: Any, transport: Any, layout: int, device: str = "cpu") -> dict[str, Any]:
    """This rank's sends and receives of one step, in its action list's order, through
    ``transport``; compute actions only pause a little (a random 0-1 ms, to vary how the
    ranks interleave). Every received tensor is checked against what its senders sent."""
    from lightning_dapple.execute.transfer.keys import transfer_key
    from lightning_dapple.execute.slicing import slice_rows
    from lightning_dapple.schedule.settle import settle_points

    schedule = schedule_for_plan(plan)
    stage = plan.stage_of_rank(rank)
    replica = plan.stages[stage].devices.index(rank)
    settle_at = settle_points(schedule.actions)[stage]
    pause = random.Random(f"{rank}/{plan.schedule}/{plan.ooo}/{layout}")
    start, checked = time.monotonic(), 0
    for position, action in enumerate(schedule.actions[stage]):
        kind, mb = action.kind, action.microbatch
        if kind.is_compute:
            time.sleep(pause.random() / 1000)
            continue
        if kind is Kind.ALLREDUCE:
            continue
        rows = slice_rows(BATCH, plan.micro_batches, mb, plan.stages[stage].replicas, replica)
        key = transfer_key(kind, stage, mb)

        def sent(by: int, sign: float) -> torch.Tensor:
            return _values(by, mb, rows, layout, sign).to(device)

        if kind is Kind.SEND_ACT:
            transport.send_activation(sent(stage, 1.0), rows, _peers(plan, stage + 1, mb, BATCH), key)
        elif kind is Kind.SEND_GRAD:
            transport.send_gradient([sent(stage, -1.0).detach()], rows, _peers(plan, stage - 1, mb, BATCH), key)
        else:
            if kind is Kind.RECV_ACT:
                got = transport.recv_activation(rows, _peers(plan, stage - 1, mb, BATCH), key)
                want = sent(stage - 1, 1.0)
            else:
                like = [sent(stage, 1.0)]
                got = transport.recv_gradient(like, rows, _peers(plan, stage + 1, mb, BATCH), key)[0]
                want = sent(stage + 1, -1.0).detach()
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, action, got.shape, want.shape)
            assert torch.equal(got.detach(), want.detach()), (rank, action)
            checked += 1
            settle = settle_at.get(position, ())
            transport.settle(frozenset(transfer_key(send_kind, stage, send_mb) for send_kind, send_mb in settle))
    transport.flush()
    return {"checked": checked, "seconds": time.monotonic() - start}


class _Routes:
    """Which process group each point-to-point call of this process used, for what."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls: dict[int, set[tuple[str, int]]] = {}
        for name in ("isend", "irecv"):
            original = getattr(dist, name)

            def recorded(tensor: torch.Tensor, peer: int, *args: Any, _name: str = name, _call: Any = original, **kwargs: Any) -> Any:
                self.calls.setdefault(id(kwargs.get("group")), set()).add((_name, peer))
                return _call(tensor, peer, *args, **kwargs)

            setattr(dist, name, recorded)  # this worker process only


def crossing_worker(rank: int, world: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Every schedule of every shape that fits the world, on one transport per shape (the
    layout changes from one schedule to the next); per case, what this rank checked."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Transport

    failure = FailureChannel(rank, timeout_s=30, poll_s=0.1)
    routes = _Routes()
    out: list[dict[str, Any]] = []
    for shape, devices in SHAPES.items():
        if sum(len(stage) for stage in devices) > world:
            continue
        first = make_plan(shape, *SCHEDULES[0])
        routes.calls.clear()
        # collective: every rank of the world builds the shape's transport (its link groups)
        transport = Transport(failure, torch.device(device), wire="nccl", links=plan_links(first))
        for layout, case in enumerate(SCHEDULES):
            plan = make_plan(shape, *case)
            result = run_action_list(rank, plan, transport, layout, device) if rank < plan.world_size else None
            out.append({"shape": shape, "case": case, "result": result})
        used = sorted(sorted(uses) for group, uses in routes.calls.items())
        out.append({"shape": shape, "routes": used, "default_group_used": id(None) in routes.calls})
    failure.close()
    return out


def expected_receives(plan: Any, rank: int) -> int:
    stage = plan.stage_of_rank(rank)
    return sum(1 for action in schedule_for_plan(plan).actions[stage] if action.kind in (Kind.RECV_ACT, Kind.RECV_GRAD))


def check_crossing(results: dict[Any, Any], world: int, bound_s: float) -> int:
    """Assert every case of ``crossing_worker`` completed, checked every receive of its
    action lists and stayed within ``bound_s``, and that the wire's process groups each
    carried one direction between one pair of ranks; the number of cases checked."""
    assert "__errors__" not in results, results.get("__errors__")
    cases = 0
    for rank in range(world):
        for entry in results[rank]:
            if "routes" in entry:
                assert not entry["default_group_used"], (rank, entry)
                assert all(len(uses) == 1 for uses in entry["routes"]), (rank, entry["shape"], entry["routes"])
                continue
            plan = make_plan(entry["shape"], *entry["case"])
            if rank >= plan.world_size:
                continue
            got = entry["result"]
            assert got["checked"] == expected_receives(plan, rank), (rank, entry)
            assert got["seconds"] < bound_s, (rank, entry)
            cases += 1
    return cases


@pytest.mark.timeout(420)
def test_every_schedule_runs_through_the_nccl_wire_with_crossing_traffic() -> None:
    results = run_ranks(crossing_worker, 5, timeout_s=360)
    cases = check_crossing(results, 5, bound_s=60.0)
    assert cases == len(SCHEDULES) * sum(sum(len(stage) for stage in devices) for devices in SHAPES.values())



def streams_worker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends rank 1 boundary 0's activation, then boundary 2's; rank 1 takes boundary
    2's first, as a rank holding several stages may: on the ``nccl`` wire each stream (a
    boundary and direction) must have a communicator of its own, or the first receive meets
    the other boundary's message."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.keys import TransferKey
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    failure = FailureChannel(rank, timeout_s=30, poll_s=0.1)
    routes = _Routes()
    transport = Transport(failure, torch.device("cpu"), wire="nccl", links=[(0, 1, 0), (0, 1, 2)], tagged=True)
    rows = (0, 4)
    keys = {boundary: TransferKey(Direction.ACTIVATION, 0, boundary) for boundary in (0, 2)}
    values = {boundary: _values(boundary, 0, rows, 0, 1.0) for boundary in (0, 2)}
    received: dict[int, bool] = {}
    for boundary in (0, 2) if rank == 0 else (2, 0):
        if rank == 0:
            transport.send_activation(values[boundary], rows, [Peer(1, rows)], keys[boundary])
        else:
            got = transport.recv_activation(rows, [Peer(0, rows)], keys[boundary])
            received[boundary] = torch.equal(got.detach(), values[boundary].detach())
    transport.flush()
    failure.close()
    return {"received": received, "routes": sorted(sorted(uses) for uses in routes.calls.values())}


@pytest.mark.timeout(120)
def test_the_nccl_wire_gives_each_stream_of_a_link_its_own_communicator() -> None:
    results = run_ranks(streams_worker, 2, timeout_s=90)
    assert "__errors__" not in results, results.get("__errors__")
    assert results[1]["received"] == {2: True, 0: True}
    # two communicators, each carrying one stream's messages (the wire's first messages aside)
    for rank, peer, verb in ((0, 1, "isend"), (1, 0, "irecv")):
        assert results[rank]["routes"] == [[(verb, peer)], [(verb, peer)]], results[rank]
