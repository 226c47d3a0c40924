"""Where a rank may wait for its own earlier sends without adding a dependency.

Sends are asynchronous: a send's buffer is handed to the backend and the rank computes on.
With gloo the data of a send goes out only once the receiver has posted its receive (a
rendezvous), and then it is gloo's I/O thread that writes it -- concurrently with this
rank's compute. When every core already computes, that thread preempts the compute.
``torch.distributed.pipelining`` instead waits for its sends together with its next
receive, while it is blocked anyway. On 2 ranks sharing 2 cores (``benchmarks/bench_pair.py
torch-1F1B dapple dapple-nosettle``, width 512, three runs of 40 blocks) waiting at the
points below gave dapple / torch-1F1B medians of 0.99 at M=4 and M=8, against 1.01 without.

Waiting for a send can add a dependency, and a cycle of dependencies is a deadlock. A
receive action ``r`` of stage s from peer stage p may wait for a send ``S`` of stage s to
the same peer stage when, in stage p's action list, the receive matching ``S`` comes before
the send matching ``r``. Then a peer that has sent what ``r`` waits for has already passed
(and so posted) the receive of ``S``, so ``S`` completes without either side waiting for
more: the new wait is implied by the one ``r`` already has. Every replica of a stage runs
the same list, so the rule holds for split-concat transfers too (DAPPLE 5.2.2). A send whose
receive comes after the peer's send but before the peer's next receive is safe as well:
between the two the peer only computes and sends, which never block.

``settle_points`` computes, for each receive action, the earlier sends it may wait for.
Plain data from plain data: the simulator's action lists in, sets of (kind, micro-batch) out.

Merged orders (``group_settle_points``). A rank holding several stages (interleaved 1F1B,
ZB-V) runs one merged order of their actions, so what it knows about a peer comes from the
peer's merged order, not from one stage's list: the peer may run another chunk's work
between a send and its next receive. There the rule is taken one step further back, to what
has certainly happened: a receive of group g completes only after the peer's matching send
was issued, so from then on g knows that every action before that send in the peer's order
is done -- every receive among them posted and completed -- and, transitively, what the peer
knew when it sent (vector clocks over the groups' orders, built by playing the orders with
blocking receives). Each send of g across groups is then waited at g's first blocking
receive after it by which its matching receive is known to be complete: the wait adds no
dependency at all (only the data's last bytes may still be on the way), and the send's
buffer is freed there instead of at the end of the step. A boundary between two stages of
the same group is a hand-off in process: neither a send to wait for nor a point that blocks.
Sends after a group's last such point stay for the end of the step.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.schedule.actions import Action, Kind, Schedule

SendKey = tuple[Kind, int]  # (SEND_ACT or SEND_GRAD, micro-batch)
StageSendKey = tuple[Kind, int, int]  # (SEND_ACT or SEND_GRAD, stage, micro-batch)

# a receive of this kind comes from the stage at this offset, which sends it with this kind;
# our sends to that stage are of the other kind, received there as the last kind
_PEER = {
    Kind.RECV_GRAD: (+1, Kind.SEND_GRAD, Kind.SEND_ACT, Kind.RECV_ACT),
    Kind.RECV_ACT: (-1, Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD),
}


def settle_points(actions: list[list]) -> list[dict[int, frozenset[SendKey]]]:
    """Per stage: receive position -> the sends of that stage issued before it that the
    receive may wait for once its own data has arrived (see the module docstring)."""
    positions = [{(action.kind, action.microbatch): index for index, action in enumerate(stage)} for stage in actions]
    out: list[dict[int, frozenset[SendKey]]] = []
    for stage, own in enumerate(actions):
        points: dict[int, frozenset[SendKey]] = {}
        for index, action in enumerate(own):
            if action.kind not in _PEER:
                continue
            offset, their_send, our_send, their_recv = _PEER[action.kind]
            peer = stage + offset
            if not 0 <= peer < len(actions):
                continue
            sent_at = positions[peer].get((their_send, action.microbatch))
            if sent_at is None:
                continue
            # the peer posts receives up to its first blocking point after sending ours
            reach = next(
                (at for at in range(sent_at + 1, len(actions[peer])) if actions[peer][at].kind in _PEER),
                len(actions[peer]),
            )
            reach = reach + 1 if reach < len(actions[peer]) else reach  # that receive is posted too
            keys = {
                (our_send, earlier.microbatch)
                for earlier in own[:index]
                if earlier.kind is our_send and positions[peer].get((their_recv, earlier.microbatch), reach) < reach
            }
            if keys:
                points[index] = frozenset(keys)
        out.append(points)
    return out


# a send of this kind is taken by the stage at this offset, with a receive of this kind
_TAKEN_BY = {Kind.SEND_ACT: (+1, Kind.RECV_ACT), Kind.SEND_GRAD: (-1, Kind.RECV_GRAD)}
# a receive of this kind is given by the stage at this offset, with a send of this kind
_GIVEN_BY = {kind: (offset, their_send) for kind, (offset, their_send, _, _) in _PEER.items()}


def group_settle_points(schedule: Schedule) -> list[dict[int, frozenset[StageSendKey]]]:
    """Per device group: position in its merged order (``Schedule.group_actions``) of a
    blocking receive -> the group's earlier sends first known there to be received (module
    docstring, "Merged orders"). Works for any schedule, one stage per group included."""
    orders = [schedule.group_actions(group) for group in range(schedule.num_groups)]
    where = {(a.kind, a.stage, a.microbatch): (group, index) for group, order in enumerate(orders) for index, a in enumerate(order)}
    known = _known_progress(schedule, orders, where)
    out: list[dict[int, frozenset[StageSendKey]]] = []
    for group, order in enumerate(orders):
        points: dict[int, set[StageSendKey]] = {}
        blocking = sorted(known[group])
        for index, action in enumerate(order):
            if action.kind not in _TAKEN_BY or not _crosses(schedule, action):
                continue  # not a send over a wire
            offset, their_recv = _TAKEN_BY[action.kind]
            peer, at = where[(their_recv, action.stage + offset, action.microbatch)]
            point = next((i for i in blocking if i > index and known[group][i][peer] > at), None)
            if point is not None:
                points.setdefault(point, set()).add((action.kind, action.stage, action.microbatch))  # type: ignore[arg-type]
        out.append({index: frozenset(keys) for index, keys in points.items()})
    return out


def _crosses(schedule: Schedule, action: Action) -> bool:
    """Whether a transfer action crosses to another device group (a wire, not a hand-off)."""
    route = _TAKEN_BY.get(action.kind) or _GIVEN_BY.get(action.kind)
    if route is None:
        return False
    offset = route[0]
    peer = action.stage + offset
    return 0 <= peer < schedule.num_stages and schedule.group_of(peer) != schedule.group_of(action.stage)


def _known_progress(
    schedule: Schedule, orders: Sequence[Sequence[Action]], where: dict[tuple, tuple[int, int]]
) -> list[dict[int, tuple[int, ...]]]:
    """Per group, per blocking receive position: for every group, how many of its leading
    actions are known complete once that receive is (a vector clock). Plays the orders:
    everything but a receive across groups runs at once; such a receive completes once its
    send was issued, and merges the clock the sender had then."""
    groups = len(orders)
    clock = [[0] * groups for _ in range(groups)]
    at_send: dict[tuple[int, int], tuple[int, ...]] = {}
    known: list[dict[int, tuple[int, ...]]] = [{} for _ in range(groups)]
    pc = [0] * groups
    moved = True
    while moved:
        moved = False
        for group, order in enumerate(orders):
            while pc[group] < len(order):
                action = order[pc[group]]
                if action.kind in _GIVEN_BY and _crosses(schedule, action):  # a receive that blocks
                    offset, their_send = _GIVEN_BY[action.kind]
                    sender = where[(their_send, action.stage + offset, action.microbatch)]
                    if sender not in at_send:
                        break
                    clock[group] = [max(a, b) for a, b in zip(clock[group], at_send[sender])]
                    clock[group][sender[0]] = max(clock[group][sender[0]], sender[1] + 1)
                    known[group][pc[group]] = tuple(clock[group])
                elif action.kind in _TAKEN_BY and _crosses(schedule, action):  # a send: what the receiver will learn
                    clock[group][group] = pc[group] + 1
                    at_send[(group, pc[group])] = tuple(clock[group])
                pc[group] += 1
                moved = True
    stuck = [group for group, order in enumerate(orders) if pc[group] < len(order)]
    if stuck:
        raise ValueError(f"schedule {schedule.name!r}: device group {stuck[0]} waits at {orders[stuck[0]][pc[stuck[0]]]} for a send that never comes")
    return known
