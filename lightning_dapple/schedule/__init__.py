"""Schedules: per-stage action lists (GPipe, DAPPLE early backward, their out-of-order
backprop versions) and the K_i policies."""
from lightning_dapple.schedule.actions import Action, Kind
from lightning_dapple.schedule.builders import Schedule, build_schedule, compute_order, schedule_for_plan
from lightning_dapple.schedule.ooo import build_ooo_schedule
from lightning_dapple.schedule.policy import warmup_counts

__all__ = ["Action", "Kind", "Schedule", "build_ooo_schedule", "build_schedule", "compute_order", "schedule_for_plan", "warmup_counts"]
