"""Schedules: per-stage action lists (GPipe, DAPPLE early backward, their out-of-order
backprop versions, and, with several stages per device group, interleaved 1F1B and ZB-V).
The K_i they follow come from the plan (``plan.warmup``)."""
from lightning_dapple.schedule.actions import Action, Kind, Schedule, group_stash_walk, stash_walk
from lightning_dapple.schedule.builders import build_schedule, compute_order
from lightning_dapple.schedule.interleaved import build_interleaved_schedule
from lightning_dapple.schedule.ooo import build_ooo_schedule
from lightning_dapple.schedule.zbv import build_zbv_schedule

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "build_interleaved_schedule",
    "build_ooo_schedule",
    "build_schedule",
    "build_zbv_schedule",
    "compute_order",
    "group_stash_walk",
    "stash_walk",
]
