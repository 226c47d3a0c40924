"""Builders of the two schedules of the product: GPipe and DAPPLE early backward.

* GPipe (gpipe.txt sec. 2): every stage runs all M forwards, then all M backwards.
* DAPPLE (dapple-ppopp21.txt sec. 3.2, 5.3): stage i runs K_i forwards, then strictly one
  backward, one forward, ... (the backward of its oldest micro-batch first), then the
  remaining backwards. The stage never holds more than K_i micro-batches' activations.

Communication actions are inserted around compute: a stage receives a micro-batch's input
right before its forward and its output gradient right before its backward, and sends as
soon as the compute that produced the tensor is done.

With out-of-order backprop (``plan.ooo``, ooo-backprop sec. 3 and 5.2) the same F/B order
gets W actions for the deferred weight gradients; ``lightning_dapple.schedule.ooo`` places
them. A schedule also carries each stage's recomputation mode (gpipe.txt 2.3), which both
the simulator (extra forward before a recomputed backward) and the executor read.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.schedule.actions import Action, Kind, Schedule


def compute_order(name: str, stage: int, num_stages: int, micro_batches: int, warmup: int) -> list[Action]:
    """Order of F and B actions on ``stage`` for schedule ``name``."""
    forwards = [Action(Kind.F, stage, mb) for mb in range(micro_batches)]
    backwards = [Action(Kind.B, stage, mb) for mb in range(micro_batches)]
    spec = schedule_spec(name)
    require(not spec.chunked, "schedule", f"is {name!r}, which runs several stages per device group", "build it with its own builder (schedule.registry.build_named)")
    if spec.holds_every_micro_batch:
        return forwards + backwards
    warmup = max(1, min(warmup, micro_batches))
    order = forwards[:warmup]
    next_forward = warmup
    for backward in backwards:
        order.append(backward)
        if next_forward < micro_batches:
            order.append(forwards[next_forward])
            next_forward += 1
    return order


def with_transfers(action: Action, num_stages: int) -> list[Action]:
    """``action`` with the receive it waits for before it and the send of its result after it.

    F receives the activation from the previous stage and sends its output on; a backward
    (B or I) receives the output gradient from the next stage and sends the input gradient
    back. The pipeline's first stage has no previous and its last stage no next stage.
    Boundaries between two stages on the same device group keep their actions too: such a
    hand-off is local, but every stage's list reads the same.
    """
    stage = action.stage
    first, last = stage == 0, stage == num_stages - 1
    if action.kind is Kind.F:
        return [*([] if first else [Action(Kind.RECV_ACT, stage, action.microbatch)]), action, *([] if last else [Action(Kind.SEND_ACT, stage, action.microbatch)])]
    if action.kind.is_backward:
        return [*([] if last else [Action(Kind.RECV_GRAD, stage, action.microbatch)]), action, *([] if first else [Action(Kind.SEND_GRAD, stage, action.microbatch)])]
    return [action]


def with_communication(order: Sequence[Action], stage: int, num_stages: int) -> list[Action]:
    """Insert receives before and sends after each compute action of ``stage``."""
    actions = [expanded for action in order for expanded in with_transfers(action, num_stages)]
    actions.append(Action(Kind.ALLREDUCE, stage))
    return actions


def build_schedule(name: str, num_stages: int, micro_batches: int, warmups: Sequence[int] | None = None) -> Schedule:
    """The action lists of schedule ``name`` for S stages and M micro-batches."""
    require(num_stages >= 1, "num_stages", f"is {num_stages}", "use at least one stage")
    require(micro_batches >= 1, "micro_batches", f"is {micro_batches}", "use at least one micro-batch")
    if warmups is None:
        warmups = warmup_counts(num_stages, micro_batches, "PA", schedule=name)
    require(len(warmups) == num_stages, "warmups", f"has {len(warmups)} entries for {num_stages} stages", "give one K_i per stage")
    if schedule_spec(name).holds_every_micro_batch:
        warmups = [micro_batches] * num_stages
    lists = tuple(
        tuple(with_communication(compute_order(name, s, num_stages, micro_batches, warmups[s]), s, num_stages))
        for s in range(num_stages)
    )
    return Schedule(name, num_stages, micro_batches, tuple(int(min(k, micro_batches)) for k in warmups), lists)
