"""Lightning glue: the DappleStrategy and its registration as "dapple" / "dapple_spawn".

``DappleStrategy`` is loaded on first use, so that importing a light submodule (the
registry, the ooo choice) does not load Lightning."""
from __future__ import annotations

from typing import Any

__all__ = ["DappleStrategy"]


def __getattr__(name: str) -> Any:
    if name == "DappleStrategy":
        from lightning_dapple.strategy.dapple_strategy import DappleStrategy

        return DappleStrategy
    raise AttributeError(name)
