"""Schedules as per-stage action lists, shared by the simulator and the executor.

Like ``torch.distributed.pipelining``'s schedules, a schedule is data: for every stage an
ordered list of actions. Compute actions are F (forward of one micro-batch), B (backward;
with out-of-order backprop only the input-gradient half, ooo-backprop sec. 3) and W (the
deferred weight-gradient half). Communication actions move a micro-batch boundary between
adjacent stages (DAPPLE 5.2.2 split-concat when their widths differ). ALLREDUCE syncs the
stage's gradients among its replicas once its last backward is done (DAPPLE 5.2.3).

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

    def __str__(self) -> str:
        if self.microbatch is None:
            return f"{self.kind.value}@s{self.stage}"
        return f"{self.kind.value}{self.microbatch}@s{self.stage}"
