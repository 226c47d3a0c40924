"""Schedules: per-stage action lists (GPipe, DAPPLE early backward, their out-of-order
backprop versions). The K_i they follow come from the plan (``plan.warmup``)."""
from lightning_dapple.schedule.actions import Action, Kind, Schedule, stash_walk
from lightning_dapple.schedule.builders import build_schedule, compute_order
from lightning_dapple.schedule.ooo import build_ooo_schedule

__all__ = ["Action", "Kind", "Schedule", "build_ooo_schedule", "build_schedule", "compute_order", "stash_walk"]
