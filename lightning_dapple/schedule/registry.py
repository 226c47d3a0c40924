"""Schedule builders looked up by name, through the one table of schedules.

``plan.schedule_table`` holds each schedule's row, including where its builder lives; this
module turns the row's ``"module:function"`` into the function (once per name) and calls it
with the arguments it takes, so the simulator and the executor build any schedule the
same way (as ``torch.distributed.pipelining`` looks its schedules up with
``get_schedule_class``). A builder takes any of the keyword arguments of
:func:`build_named`; ``build_schedule`` (DAPPLE and GPipe) also takes the name itself.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import replace
from functools import lru_cache
from typing import Any, Callable, Sequence

from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.schedule.actions import Schedule

__all__ = ["build_named", "builder_for"]


@lru_cache(maxsize=None)
def builder_for(name: str) -> Callable[..., Schedule]:
    """The builder function of schedule ``name`` (its table row's ``builder``)."""
    module_name, _, function_name = schedule_spec(name).builder.partition(":")
    return getattr(importlib.import_module(module_name), function_name)


@lru_cache(maxsize=None)
def _accepted(name: str) -> frozenset[str]:
    return frozenset(inspect.signature(builder_for(name)).parameters)


def build_named(
    name: str,
    *,
    num_groups: int,
    micro_batches: int,
    warmups: Sequence[int] | None,
    chunks: int = 1,
    recompute: Sequence[str] = (),
) -> Schedule:
    """Schedule ``name`` for ``num_groups`` device groups of ``chunks`` stages each.

    ``warmups``: K per device group (``None``: the builder's policy P_A). A one-stage-per-
    group schedule has ``num_groups`` stages; ``recompute`` (a mode per stage) is carried
    onto the schedule when its builder does not take it.
    """
    offered: dict[str, Any] = {
        "name": name,
        "num_stages": num_groups * chunks,
        "num_groups": num_groups,
        "chunks": chunks,
        "micro_batches": micro_batches,
        "warmups": warmups,
        "recompute": tuple(recompute),
    }
    accepted = _accepted(name)
    built = builder_for(name)(**{key: value for key, value in offered.items() if key in accepted})
    if "recompute" not in accepted and any(mode != "never" for mode in recompute):
        built = replace(built, recompute=tuple(recompute))
    return built
