"""Discrete-event simulation of DAPPLE/GPipe schedules and timeline pictures (DAPPLE Fig. 3-4).

``draw_timeline`` imports matplotlib only when called.
"""
from lightning_dapple.simulate.engine import (
    ScheduleDeadlock,
    SimulationResult,
    Span,
    StageResult,
    simulate,
)
from lightning_dapple.simulate.plan_and_schedule import check_plan_fits, simulate_plan
from lightning_dapple.simulate.timeline_png import draw_timeline

__all__ = [
    "ScheduleDeadlock",
    "SimulationResult",
    "Span",
    "StageResult",
    "check_plan_fits",
    "draw_timeline",
    "simulate",
    "simulate_plan",
]
