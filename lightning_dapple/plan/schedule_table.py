"""The schedules this package knows, in one table: name -> what every layer needs to know.

A schedule name travels from the user (``DappleStrategy(schedule=...)``, ``--schedule``,
a plan file) through the planner, the simulator and the executor. Each of them asks the
same few questions of it, and this table answers them, so that adding a schedule is one
row here and one builder in ``lightning_dapple/schedule/``:

* ``builder``: where its action lists are built, as ``"module:function"`` (the way Hydra
  names a ``_target_``). The table sits in ``plan`` because the planner must know a
  schedule's shape and warm-up rule, and ``plan`` is below ``schedule`` in the package's
  layers; ``lightning_dapple.schedule.registry`` resolves the path (and a test holds that
  every path resolves to a function in ``lightning_dapple.schedule``);
* ``chunked``: whether it runs several stages (chunks) on each device group, and
  ``fixed_chunks`` when the count is part of the schedule (ZB-V's V has exactly 2);
* ``splits_backward``: whether every backward is split into its input-gradient half (I)
  and a deferred weight-gradient half (W) by the schedule itself (ZB-V); the other
  schedules split only under out-of-order backprop (``plan.ooo``);
* ``holds_every_micro_batch``: whether every stage runs all M forwards before its first
  backward (GPipe), so K_i = M and the stash holds M micro-batches;
* ``chunk_placement``: how a chunked schedule places its stages on the device groups,
  ``"round_robin"`` (stage k on group k mod P) or ``"vee"`` (down the groups and back up);
* ``warmup_rule``: how K_i is set, in words (the counts are ``plan.warmup``'s).

``DEFAULT_SCHEDULE`` is the planner's own (DAPPLE's early backward), kept when no other
schedule fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from lightning_dapple.errors import require

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULE_TABLE", "ScheduleSpec", "chunked_schedule_names", "schedule_names", "schedule_spec"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule's row (the module docstring says what each field is for)."""

    name: str
    summary: str
    builder: str
    chunked: bool = False
    fixed_chunks: int | None = None
    splits_backward: bool = False
    holds_every_micro_batch: bool = False
    chunk_placement: str = ""
    warmup_rule: str = ""

    @property
    def early_backward(self) -> bool:
        """One stage per device group, K_i forwards, then a backward and a forward at a time
        (DAPPLE 3.2): the schedule whose K_i must not grow along the pipeline."""
        return not self.chunked and not self.holds_every_micro_batch


DEFAULT_SCHEDULE = "dapple"

SCHEDULE_TABLE: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec(
            "dapple",
            "DAPPLE's early backward: K_i forwards, then one backward and one forward at a time (DAPPLE 3.2)",
            builder="lightning_dapple.schedule.builders:build_schedule",
            warmup_rule="P_A: K_i = min(S - i, M); P_B: K_i = min(2(S - i) - 1, M), capped by memory (DAPPLE 5.3)",
        ),
        ScheduleSpec(
            "gpipe",
            "GPipe: every forward, then every backward (GPipe sec. 2.2)",
            builder="lightning_dapple.schedule.builders:build_schedule",
            holds_every_micro_batch=True,
            warmup_rule="K_i = M: all micro-batches are in flight before the first backward",
        ),
        ScheduleSpec(
            "interleaved",
            "Megatron's interleaved 1F1B: v chunks per device group (Narayanan et al. 2021, sec. 2.2)",
            builder="lightning_dapple.schedule.interleaved:build_interleaved_schedule",
            chunked=True,
            chunk_placement="round_robin",
            warmup_rule="(v - 1) P forwards to fill the earlier chunks, then DAPPLE's rule on the last chunk",
        ),
        ScheduleSpec(
            "zbv",
            "Zero-bubble V: 2 chunks per device group in a V, weight gradients fill the bubbles (Qi et al. 2024, sec. 6)",
            builder="lightning_dapple.schedule.zbv:build_zbv_schedule",
            chunked=True,
            fixed_chunks=2,
            splits_backward=True,
            chunk_placement="vee",
            warmup_rule="at most 2P chunk micro-batches in flight per device group (P_A), 4P - 2 (P_B)",
        ),
    )
}


def schedule_names() -> tuple[str, ...]:
    """Every schedule's name, in the table's order."""
    return tuple(SCHEDULE_TABLE)


def chunked_schedule_names() -> tuple[str, ...]:
    """The schedules that place several stages on each device group."""
    return tuple(name for name, spec in SCHEDULE_TABLE.items() if spec.chunked)


def schedule_spec(name: str, what: str = "schedule") -> ScheduleSpec:
    """The row of schedule ``name``; a one-line error naming the known ones otherwise."""
    require(name in SCHEDULE_TABLE, what, f"is {name!r}, which is not a schedule", f"use one of {list(SCHEDULE_TABLE)}")
    return SCHEDULE_TABLE[name]
