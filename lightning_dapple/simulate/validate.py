"""``validate_schedule``: check a schedule written by hand, as text, before any rank runs it.

A schedule is data (``schedule.actions``), and its text form round-trips
(``format_actions`` / ``parse_actions``), so a user can write one line of actions per
stage -- ``0F0 0SEND_F0 0F1 ...`` -- to try an order the builders do not make. Before it
runs, three things must hold, and each failure is one line naming the action and the fix:

* every action is well formed for its stage (the simulator's own structural check: the
  right stage, micro-batch ids 0..M-1, each action once, an I followed by its W);
* every stage runs every micro-batch: one forward and one backward (B, or I with its W)
  for each of 0..M-1, and a stage that talks to a neighbour receives and sends every
  micro-batch it computes;
* the order completes: a dry run with unit costs never waits on something queued behind
  itself (whether an order can deadlock does not depend on the durations, so a dry run
  decides it).

``placement`` gives the device group of each stage when several stages share a group
(interleaved, ZB-V); the text then holds one line per device group, its merged order.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.costs import StageCost
from lightning_dapple.schedule.actions import Action, Kind, Schedule, parse_actions
from lightning_dapple.simulate.engine import ScheduleDeadlock, simulate

__all__ = ["validate_schedule"]

_UNIT = StageCost(
    forward_ms=1.0, backward_ms=2.0, backward_input_ms=1.0, backward_weight_ms=1.0, param_bytes=0.0,
    stash_bytes=0.0, output_bytes=0.0, send_ms=0.0, allreduce_ms=0.0, slice_size=1.0,
)


def validate_schedule(text: str, placement: Sequence[int] = (), name: str = "custom") -> Schedule:
    """The :class:`Schedule` that ``text`` describes, after checking it can run.

    ``text``: one line per stage (or, with ``placement``, one line per device group: its
    merged order), actions in the text form of ``schedule.actions``. The number of stages
    and M are read from the actions. Raises ``DappleConfigError`` naming the first problem.
    """
    try:
        lines = parse_actions(text)
    except ValueError as error:
        raise DappleConfigError("schedule text", str(error), "write each action as <stage><KIND>[<microbatch>], one line per stage") from None
    require(bool(lines), "schedule text", "has no actions", "write one line of actions per stage")
    every = [action for line in lines for action in line]
    num_stages = 1 + max(action.stage for action in every)
    micro_batches = 1 + max((action.microbatch for action in every if action.microbatch is not None), default=-1)
    require(micro_batches >= 1, "schedule text", "names no micro-batch", "list at least F0 and B0 on every stage")
    if placement:
        schedule = _grouped(name, lines, tuple(placement), num_stages, micro_batches)
    else:
        require(
            len(lines) == num_stages,
            "schedule text",
            f"has {len(lines)} lines but names stages up to {num_stages - 1}",
            "write one line per stage, or give placement= for several stages per device group",
        )
        schedule = Schedule(name, num_stages, micro_batches, (1,) * num_stages, lines)
    for stage, actions in enumerate(schedule.actions):
        _require_every_micro_batch(stage, actions, micro_batches, num_stages)
    try:
        simulate(schedule, [_UNIT] * num_stages)
    except ScheduleDeadlock as error:
        problem, _, fix = str(error).partition(". Fix: ")
        raise DappleConfigError("schedule text", f"cannot complete: {problem}", fix or "reorder the stuck stage's actions so each waits only for work listed before it") from None
    return schedule


def _grouped(name: str, lines: tuple[tuple[Action, ...], ...], placement: tuple[int, ...], num_stages: int, micro_batches: int) -> Schedule:
    require(len(placement) == num_stages, "placement", f"has {len(placement)} entries for {num_stages} stages", "give the device group of every stage")
    require(
        len(lines) == len(set(placement)),
        "schedule text",
        f"has {len(lines)} lines for {len(set(placement))} device groups",
        "write one line per device group: its merged order",
    )
    actions = tuple(tuple(a for a in lines[placement[stage]] if a.stage == stage) for stage in range(num_stages))
    return Schedule(name, num_stages, micro_batches, (1,) * num_stages, actions, placement=placement, orders=lines)


def _require_every_micro_batch(stage: int, actions: Sequence[Action], micro_batches: int, num_stages: int) -> None:
    """Each micro-batch's forward and backward on ``stage``, with the transfers they need."""
    present = {(action.kind, action.microbatch) for action in actions}
    wanted = [(Kind.F, "F", "its forward")]
    if stage > 0:
        wanted += [(Kind.RECV_ACT, "RECV_F", "the receive of its activation"), (Kind.SEND_GRAD, "SEND_B", "the send of its input gradient")]
    if stage < num_stages - 1:
        wanted += [(Kind.SEND_ACT, "SEND_F", "the send of its output"), (Kind.RECV_GRAD, "RECV_B", "the receive of its output gradient")]
    for mb in range(micro_batches):
        for kind, token, what in wanted:
            require((kind, mb) in present, f"schedule stage {stage}", f"lacks {what} for micro-batch {mb}", f"add {stage}{token}{mb}")
        require(
            (Kind.B, mb) in present or (Kind.I, mb) in present,
            f"schedule stage {stage}",
            f"lacks the backward of micro-batch {mb}",
            f"add {stage}B{mb} (or {stage}I{mb} and its {stage}W{mb})",
        )
