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
"""
from __future__ import annotations

from lightning_dapple.schedule.actions import Kind

SendKey = tuple[Kind, int]  # (SEND_ACT or SEND_GRAD, micro-batch)

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
