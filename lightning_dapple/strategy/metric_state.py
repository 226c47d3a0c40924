"""The states of the torchmetrics metrics a LightningModule holds, kept aside while set-up
runs the user's step for its own purposes (measuring the step's own time, tuning trials)
and put back afterwards, so the run's metrics count only the run's steps."""
from __future__ import annotations

import copy

from torch import nn

__all__ = ["MetricStates"]


class MetricStates:
    """Copies of every metric state under ``module`` (an accuracy accumulated over the
    epoch), taken at construction; ``restore`` puts them back."""

    def __init__(self, module: nn.Module) -> None:
        self.saved = []
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
