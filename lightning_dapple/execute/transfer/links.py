"""Which ranks exchange boundary tensors, and in which order: the NCCL wire's communicators.

DAPPLE 5.2.2: between adjacent stages each replica sends every replica of the next stage
the rows of a micro-batch that both hold (split-concat). A *link* is such a pair of ranks,
(upstream, downstream). The ``nccl`` wire gives every link one communicator per direction
(``wires.NcclWire``): NCCL runs a communicator's operations in issue order on one stream
and matches a pair's sends and receives by that order alone, so a communicator shared by
unrelated transfers makes a receive wait behind a send that has nothing to do with it.

``plan_links`` lists the links a plan can use, for any batch size. Replica ``i`` of ``r``
holds rows ``[floor(i n / r), floor((i + 1) n / r))`` of an ``n``-row micro-batch
(``slicing.row_range``), so replica ``i`` of ``r1`` and replica ``j`` of ``r2`` can share
rows only when ``[i / r1, (i + 1) / r1)`` and ``[j / r2, (j + 1) / r2)`` overlap: at most
``r1 + r2 - 1`` links per boundary, not ``r1 * r2``.

``link_orders`` replays every rank's action list as the executor issues it and gives, per
communicator, the micro-batches its sender sends and those its receiver receives, each in
issue order. NCCL needs the two to be equal (``mismatched_links`` lists where they are
not): the i-th send of a communicator meets its i-th receive, whatever transfer that is.

A rank that holds several stages (chunks of interleaved and V schedules) exchanges more than
one boundary with the same peer, in both directions: under interleaving rank 0 sends rank 1
the activations of boundary 0 and the gradients of boundary 1, and a schedule's merged
orders may send them in another order than the peer takes them. gloo matches a receive
with the oldest message of its peer and tag, so such a transport tags each boundary and
direction apart (``Transport(tagged=True)``): a *stream*; NCCL, which has no tags, gives each
stream a communicator of its own (``plan_streams``). Within a stream both ends must
still go in one order; ``stream_orders`` replays each group's merged order and lists, per
stream, the micro-batches its sender sends and its receiver takes, and
``check_stream_orders`` refuses a schedule whose two ends differ (a message would meet the
receive of another micro-batch, silently where the sizes agree). Boundaries between two
stages on the same devices are hand-offs inside the process and carry no message.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.transfer.keys import Direction, transfer_key
from lightning_dapple.execute.slicing import overlap, slice_rows
from lightning_dapple.plan.plan import Plan
from lightning_dapple.schedule.actions import Action, Kind, Schedule

__all__ = ["Link", "Channel", "Stream", "plan_links", "plan_streams", "link_orders", "mismatched_links", "stream_orders", "check_stream_orders"]

Link = tuple[int, int]  # (upstream rank, downstream rank)
Channel = tuple[Direction, int, int]  # (direction, sending rank, receiving rank): one communicator

# a communication action: its direction, where its peer stage is, and whether it sends
_MOVES = {
    Kind.SEND_ACT: (Direction.ACTIVATION, +1, True),
    Kind.RECV_ACT: (Direction.ACTIVATION, -1, False),
    Kind.SEND_GRAD: (Direction.GRADIENT, -1, True),
    Kind.RECV_GRAD: (Direction.GRADIENT, +1, False),
}


def _can_share(index: int, count: int, other: int, other_count: int) -> bool:
    """Whether replica ``index`` of ``count`` and ``other`` of ``other_count`` can hold a
    common row of some micro-batch: their fractions of it overlap (see the docstring)."""
    return index * other_count < (other + 1) * count and other * count < (index + 1) * other_count


def plan_links(plan: Plan) -> list[Link]:
    """Every (upstream, downstream) pair of ranks of adjacent stages that may exchange rows
    (once each; two stages on the same devices hand over in process and need no link)."""
    links: list[Link] = []
    for upstream, downstream in zip(plan.stages, plan.stages[1:]):
        for i, sender in enumerate(upstream.devices):
            for j, receiver in enumerate(downstream.devices):
                if sender != receiver and (sender, receiver) not in links and _can_share(i, upstream.replicas, j, downstream.replicas):
                    links.append((sender, receiver))
    return links


def plan_streams(plan: Plan) -> list[tuple[int, int, int]]:
    """``plan_links`` per boundary: every (upstream, downstream, boundary) that may carry rows,
    the streams of a rank holding several stages (module docstring), each a communicator of
    its own in each direction under NCCL (``wires.link_groups``)."""
    streams: list[tuple[int, int, int]] = []
    for boundary, (upstream, downstream) in enumerate(zip(plan.stages, plan.stages[1:])):
        for i, sender in enumerate(upstream.devices):
            for j, receiver in enumerate(downstream.devices):
                if sender != receiver and _can_share(i, upstream.replicas, j, downstream.replicas):
                    streams.append((sender, receiver, boundary))
    return streams


def link_orders(plan: Plan, actions: Sequence[Sequence[Action]], batch_rows: int) -> dict[Channel, tuple[list[int], list[int]]]:
    """Per communicator: the micro-batches its sender sends, and those its receiver
    receives, in the order their action lists issue them, for batches of ``batch_rows``."""
    orders: dict[Channel, tuple[list[int], list[int]]] = {}
    for index, stage in enumerate(plan.stages):
        for replica, rank in enumerate(stage.devices):
            for action in actions[index]:
                move = _MOVES.get(action.kind)
                if move is None or action.microbatch is None:
                    continue
                direction, offset, sends = move
                mb = action.microbatch
                peers = plan.stages[index + offset]
                mine = slice_rows(batch_rows, plan.micro_batches, mb, stage.replicas, replica)
                for peer_replica, peer in enumerate(peers.devices):
                    theirs = slice_rows(batch_rows, plan.micro_batches, mb, peers.replicas, peer_replica)
                    if overlap(mine, theirs) is None:
                        continue
                    channel = (direction, rank, peer) if sends else (direction, peer, rank)
                    orders.setdefault(channel, ([], []))[0 if sends else 1].append(mb)
    return orders


def mismatched_links(orders: dict[Channel, tuple[list[int], list[int]]]) -> list[tuple[Channel, list[int], list[int]]]:
    """The communicators whose sender and receiver issue different transfer orders."""
    return [(channel, sent, received) for channel, (sent, received) in sorted(orders.items()) if sent != received]


Stream = tuple[int, int, Direction, int]  # (sending rank, receiving rank, direction, boundary)


def stream_orders(plan: Plan, schedule: Schedule) -> dict[Stream, tuple[list[int], list[int]]]:
    """Per stream: the micro-batches its sender sends and those its receiver takes, in the
    order each rank's group runs them (``Schedule.group_actions``). Every replica pair that
    may share rows counts (``plan_links``' rule), whatever the batch: equal lists then stay
    equal for the rows any batch gives them."""
    orders: dict[Stream, tuple[list[int], list[int]]] = {}
    for group, devices in enumerate(plan.device_groups):
        for replica, rank in enumerate(devices):
            for action in schedule.group_actions(group):
                move = _MOVES.get(action.kind)
                if move is None or action.microbatch is None:
                    continue
                _, offset, sends = move
                stage, peers = plan.stages[action.stage], plan.stages[action.stage + offset]
                if peers.devices == stage.devices:
                    continue  # a hand-off inside the process
                key = transfer_key(action.kind, action.stage, action.microbatch)
                for peer_replica, peer in enumerate(peers.devices):
                    if _can_share(replica, stage.replicas, peer_replica, peers.replicas):
                        stream = (rank, peer, key.direction, key.boundary) if sends else (peer, rank, key.direction, key.boundary)
                        orders.setdefault(stream, ([], []))[0 if sends else 1].append(action.microbatch)
    return orders


def check_stream_orders(plan: Plan, schedule: Schedule) -> None:
    """Refuse a schedule whose two ends of a stream (see the module docstring) would take
    its micro-batches in different orders, naming the first where they part."""
    for (sender, receiver, direction, boundary), (sent, received) in sorted(stream_orders(plan, schedule).items()):
        if sent == received:
            continue
        at = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b), min(len(sent), len(received)))
        mine = f"micro-batch {sent[at]}" if at < len(sent) else "nothing"
        theirs = f"micro-batch {received[at]}" if at < len(received) else "nothing"
        raise DappleConfigError(
            f"schedule {schedule.name!r}",
            f"rank {sender} sends rank {receiver} the {direction._value_}s of boundary {boundary} in the order {sent} but rank "
            f"{receiver} takes them in the order {received} (#{at}: {mine} sent, {theirs} taken)",
            "list each boundary's sends and receives in one micro-batch order (the schedule builder's stage lists)",
        )
