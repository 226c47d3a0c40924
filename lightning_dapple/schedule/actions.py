"""Schedules as per-stage action lists, shared by the simulator and the executor.

Like ``torch.distributed.pipelining``'s schedules, a schedule is data: for every stage an
ordered list of actions. Compute actions are F (forward of one micro-batch), B (backward;
with out-of-order backprop only the input-gradient half, ooo-backprop sec. 3) and W (the
deferred weight-gradient half). Communication actions move a micro-batch boundary between
adjacent stages (DAPPLE 5.2.2 split-concat when their widths differ). ALLREDUCE syncs the
stage's gradients among its replicas once its last backward is done (DAPPLE 5.2.3).

``layers`` (stage-local, half-open) narrows an action to some of the stage's layers: a W
with layers computes only those layers' weight gradients (the per-layer ending phase of
ooo-backprop Algorithm 2), and an ALLREDUCE with layers is an asynchronous gradient bucket
(one of ``plan.buckets.bucket_layers``, listed in launch order) that syncs only those
layers' gradients while the stage computes on. ALLREDUCE actions tell the simulator where
buckets start; the executor starts its buckets itself when their gradients are final
(``execute/grad_sync.py``) and reads them as markers only.

Every replica of a stage runs the same list; a replica handles its slice of each
micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"
    ALLREDUCE = "allreduce"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int | None = None
    layers: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """Short form without the stage: ``F3``, ``W7[2:3]``, ``allreduce[0:1]``."""
        text = self.kind.value if self.microbatch is None else f"{self.kind.value}{self.microbatch}"
        if self.layers is not None:
            text += f"[{self.layers[0]}:{self.layers[1]}]"
        return text

    def __str__(self) -> str:
        return f"{self.label}@s{self.stage}"
