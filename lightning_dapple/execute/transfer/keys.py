"""Typed names of the transfers between adjacent stages.

DAPPLE 5.2.2: a micro-batch boundary moves between two adjacent stages twice per step, the
stage output forward (activation) and its gradient back. Each such transfer is named by a
``TransferKey``: which boundary (the stage on its upstream side), which micro-batch and which
direction. Both ends of a transfer derive the same key from their own action, so the sender
waits for its sends by key (``schedule/settle.py`` says which sends a receive may wait for)
and the receiver files the receives it posts ahead by key, without any string building on the
per-micro-batch path. How the rows of one transfer are split between the replicas of the two
stages (split-concat) is the transport's business: one key names the whole transfer, and the
transport's wait messages add the peer ranks.

The keys of an action list are computed once per plan (``StageRunner`` set-up), not per step.

A rank holding several stages exchanges several boundaries with one peer; each boundary and
direction is then a *stream* of its own (``links``), told apart by ``stream_tag``: the
message tag under gloo, the communicator under NCCL (``wires.NcclWire``).
"""
from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from lightning_dapple.schedule.actions import Kind

__all__ = ["Direction", "TransferKey", "transfer_key", "stream_tag", "TAG_BASE"]


class Direction(str, Enum):
    """Which way a transfer crosses its boundary: stage output downstream, its gradient upstream."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"


class TransferKey(NamedTuple):
    """One transfer across the boundary between stage ``boundary`` and ``boundary + 1``.

    A named tuple: hashed and compared as a plain tuple where the transport matches pending
    sends and posted receives. ``str()`` gives the label of wait and error messages
    (``"activation 3"``).
    """

    direction: Direction
    microbatch: int
    boundary: int

    def __str__(self) -> str:
        return f"{self.direction._value_} {self.microbatch}"  # _value_: no enum property call per message


# per communication kind: the direction, and the offset of the boundary from the acting stage
_ROUTE = {
    Kind.SEND_ACT: (Direction.ACTIVATION, 0),
    Kind.RECV_ACT: (Direction.ACTIVATION, -1),
    Kind.SEND_GRAD: (Direction.GRADIENT, -1),
    Kind.RECV_GRAD: (Direction.GRADIENT, 0),
}


def transfer_key(kind: Kind, stage: int, microbatch: int) -> TransferKey:
    """The transfer a communication action of ``stage`` sends or receives; the send and the
    receive of one transfer (on adjacent stages) get equal keys."""
    if kind not in _ROUTE:
        raise ValueError(f"{kind} is not a transfer between stages")
    direction, offset = _ROUTE[kind]
    return TransferKey(direction, microbatch, stage + offset)


# the first stream tag: above every other message tag of a plan (the results hand-off uses 7)
TAG_BASE = 16


def stream_tag(boundary: int, direction: Direction) -> int:
    """The tag of one boundary's transfers in one direction (module docstring)."""
    return TAG_BASE + 2 * boundary + (direction is Direction.GRADIENT)
