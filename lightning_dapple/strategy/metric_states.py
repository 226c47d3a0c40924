"""The states of the torchmetrics metrics a step updates, copied and put back.

Work the strategy runs on the user's ``training_step`` outside training (timing its glue at
set-up, ``step_glue.py``; the trials of ``tune_steps``, ``plan_tuning.py``) would otherwise
add to a metric the step accumulates over the epoch (an accuracy), and the first epoch's
value would count steps that never trained.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import nn

__all__ = ["MetricStates"]


class MetricStates:
    """The states of every torchmetrics ``Metric`` under a module (found by its registered
    state defaults, so torchmetrics need not be imported), copied now and put back by
    ``restore``."""

    def __init__(self, module: nn.Module) -> None:
        self.saved: list[tuple[Any, dict[str, Any], int, Any]] = []
        for metric in module.modules():
            defaults = getattr(metric, "_defaults", None)
            if isinstance(defaults, dict) and hasattr(metric, "_update_count"):
                state = {name: copy.deepcopy(getattr(metric, name)) for name in defaults}
                self.saved.append((metric, state, metric._update_count, getattr(metric, "_computed", None)))

    def restore(self) -> None:
        for metric, state, count, computed in self.saved:
            for name, value in state.items():
                setattr(metric, name, value)
            metric._update_count = count
            metric._computed = computed
