"""The same parameter groups, by position, in every rank's optimizer.

Each rank builds its optimizer over the parameters of its own stages, so a parameter group
over layers that live elsewhere is empty there. Code that adds a group only when it has
parameters, and later addresses groups by position, then reaches another group on the
ranks that did not add it: Lightning's ``BackboneFinetuning`` adds the unfrozen backbone's
group at one epoch (only where the backbone lives) and sets ``param_groups[-1]["lr"]`` at
every later one, which elsewhere would be the head's learning rate. Under DDP every rank
holds every parameter, so the groups agree by construction; here every rank appends, empty,
the groups another rank has beyond its own (same hyperparameters), once per epoch, before
the epoch's first step: epoch-start hooks then address the same groups everywhere. A
consolidated checkpoint merges the groups by position (``checkpoint.py``) and relies on it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["group_settings", "append_missing_groups"]


def group_settings(optimizers: Sequence[Any]) -> list[list[dict[str, Any]]]:
    """Per optimizer, the hyperparameters of each of its groups (without the parameters)."""
    return [[{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups] for optimizer in optimizers]


def append_missing_groups(optimizers: Sequence[Any], gather: Callable[[Any], list[Any]]) -> int:
    """Give each optimizer, empty, the groups that some rank's has beyond its own;
    ``gather`` exchanges every rank's ``group_settings``. Returns the groups appended."""
    everyone = gather(group_settings(optimizers))
    appended = 0
    for index, optimizer in enumerate(optimizers):
        longest = max((settings[index] for settings in everyone if index < len(settings)), key=len, default=[])
        for settings in longest[len(optimizer.param_groups):]:
            optimizer.add_param_group({**settings, "params": []})
            appended += 1
    return appended
