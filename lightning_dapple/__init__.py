"""lightning_dapple: DAPPLE hybrid pipeline/data-parallel training for PyTorch Lightning.

The package follows the pipeline of the DAPPLE paper (PPoPP '21):
``profile`` (per-layer costs) -> ``plan`` (section 4: partition, replication, placement)
-> ``schedule`` (sections 3 and 5.3: action lists) -> ``simulate`` (ground-truth timing of a
schedule) -> ``execute`` (multi-process interpreter of a schedule) -> ``strategy``
(Lightning glue). Importing the package registers ``strategy="dapple"`` (subprocess
launcher) and ``strategy="dapple_spawn"`` (spawn launcher) with Lightning: at once when
Lightning is already loaded, else as soon as it is (``strategy/registry.py``), so that the
planner's command-line tools start without loading Lightning.

The main roads are exported here: ``DappleStrategy``; ``make_plan`` (profile and cluster ->
the planner's plan) and ``schedule_for_plan`` (plan -> the action lists the simulator times
and the executor runs); ``validate_schedule`` (a schedule written as text -> checked action
lists). They load on first use.
"""
from __future__ import annotations

from typing import Any

from lightning_dapple.errors import DappleConfigError

__all__ = ["DappleConfigError", "DappleStrategy", "make_plan", "schedule_for_plan", "validate_schedule"]
__version__ = "0.1.0"


def _register() -> None:
    from lightning_dapple.strategy.registry import register_when_lightning_loads

    register_when_lightning_loads()


def __getattr__(name: str) -> Any:
    if name == "DappleStrategy":
        from lightning_dapple.strategy.dapple_strategy import DappleStrategy

        return DappleStrategy
    if name in ("make_plan", "schedule_for_plan"):
        from lightning_dapple.simulate import plan_and_schedule as plans

        return getattr(plans, name)
    if name == "validate_schedule":
        from lightning_dapple.simulate.validate import validate_schedule

        return validate_schedule
    raise AttributeError(name)


_register()
