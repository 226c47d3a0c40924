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
the activations of boundary 0 and the gradients of boundary 1. Every wire then matches a
pair's messages by issue order -- gloo too, whose messages all carry tag 0 -- so
``pair_orders`` replays each group's merged order and lists, per ordered pair of ranks, the
transfers (direction, micro-batch, boundary) its sender issues and its receiver takes;
``check_pair_orders`` refuses a schedule whose two ends differ (a message would meet the
receive of another transfer, silently where the sizes agree). Boundaries between two stages
on the same devices are hand-offs inside the process and carry no message.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.keys import Direction, TransferKey, transfer_key
from lightning_dapple.execute.slicing import overlap, slice_rows
from lightning_dapple.plan.plan import Plan
from lightning_dapple.schedule.actions import Action, Kind, Schedule

__all__ = ["Link", "Channel", "plan_links", "link_orders", "mismatched_links", "pair_orders", "check_pair_orders"]

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


Pair = tuple[int, int]  # (sending rank, receiving rank)


def pair_orders(plan: Plan, schedule: Schedule) -> dict[Pair, tuple[list[TransferKey], list[TransferKey]]]:
    """Per ordered pair of ranks: the transfers its sender issues and those its receiver
    takes, in the order each rank's group runs them (``Schedule.group_actions``). Every
    replica pair that may share rows counts (``plan_links``' rule), whatever the batch: equal
    lists then stay equal for the rows any batch gives them."""
    orders: dict[Pair, tuple[list[TransferKey], list[TransferKey]]] = {}
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
                        pair = (rank, peer) if sends else (peer, rank)
                        orders.setdefault(pair, ([], []))[0 if sends else 1].append(key)
    return orders


def check_pair_orders(plan: Plan, schedule: Schedule) -> None:
    """Refuse a schedule whose ranks would exchange a pair's messages in different orders
    (see the module docstring), naming the first transfer where they part."""
    for (sender, receiver), (sent, received) in sorted(pair_orders(plan, schedule).items()):
        if sent == received:
            continue
        at = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b), min(len(sent), len(received)))
        mine = sent[at] if at < len(sent) else "nothing"
        theirs = received[at] if at < len(received) else "nothing"
        raise DappleConfigError(
            f"schedule {schedule.name!r}",
            f"rank {sender} sends rank {receiver} transfer #{at} as {_describe(mine)} but rank {receiver} receives "
            f"{_describe(theirs)} there; both ends of a rank pair must issue its transfers in the same order",
            "build the merged orders so that each pair's sends and receives come in one order (schedule builders), or use a schedule with one stage per device group",
        )


def _describe(key: TransferKey | str) -> str:
    if isinstance(key, str):
        return key
    return f"{key.direction._value_} {key.microbatch} of boundary {key.boundary}"
