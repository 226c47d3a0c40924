"""Register "dapple" and "dapple_spawn" in Lightning's StrategyRegistry.

``import lightning_dapple`` must make ``Trainer(strategy="dapple")`` work, but loading
Lightning takes seconds, which the planner's command-line tools (``dapple-plan --help``)
should not pay. So the package registers at once when ``lightning.pytorch`` is already
loaded, and otherwise hooks the import system to register right after it loads: a user who
writes ``import lightning_dapple`` and then ``from lightning.pytorch import Trainer`` gets the
strategy either way.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_WATCHED = "lightning.pytorch"


#: registered name -> (start method of Lightning's launcher, description)
NAMES = {
    "dapple": ("popen", "DAPPLE pipeline/data-parallel strategy (subprocess launcher)"),
    "dapple_spawn": ("spawn", "DAPPLE pipeline/data-parallel strategy (spawn launcher)"),
}


def _dapple_strategy(**kwargs: Any) -> Any:
    """The registry's factory: the strategy module loads when a Trainer asks for it, not while
    Lightning itself is still loading (a module of ours may be what is loading it)."""
    from lightning_dapple.strategy.dapple_strategy import DappleStrategy

    return DappleStrategy(**kwargs)


def register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (start_method, description) in NAMES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _dapple_strategy, description=description, start_method=start_method)


class _RegisterAfterLoad(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``lightning.pytorch`` so that registration
    runs once that module has executed, then steps out of the import system."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _WATCHED:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_and_register(module: Any) -> None:
            execute(module)
            register()

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def register_when_lightning_loads() -> None:
    """Register now if Lightning is loaded, else right after it loads (never twice)."""
    if _WATCHED in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterAfterLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLoad())
