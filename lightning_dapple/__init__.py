"""lightning_dapple: DAPPLE hybrid pipeline/data-parallel training for PyTorch Lightning.

The package follows the pipeline of the DAPPLE paper (shared/papers/dapple-ppopp21.txt):
``profile`` (per-layer costs) -> ``plan`` (section 4: partition, replication, placement)
-> ``schedule`` (sections 3 and 5.3: action lists) -> ``simulate`` (ground-truth timing of a
schedule) -> ``execute`` (multi-process interpreter of a schedule) -> ``strategy``
(Lightning glue). Importing the package registers ``strategy="dapple"`` (subprocess
launcher) and ``strategy="dapple_spawn"`` (spawn launcher) with Lightning.
"""
from __future__ import annotations

from typing import Any

from lightning_dapple.errors import DappleConfigError

__all__ = ["DappleConfigError", "DappleStrategy"]
__version__ = "0.1.0"


def _register() -> None:
    try:
        from lightning_dapple.strategy.registry import register
    except ImportError:  # lightning missing: planner/simulator still usable
        return
    register()


def __getattr__(name: str) -> Any:
    if name == "DappleStrategy":
        from lightning_dapple.strategy.dapple_strategy import DappleStrategy

        return DappleStrategy
    raise AttributeError(name)


_register()
