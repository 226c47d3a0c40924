"""Register "dapple" and "dapple_spawn" in Lightning's StrategyRegistry on import."""
from __future__ import annotations


def register() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_dapple.strategy.dapple_strategy import DappleStrategy

    if "dapple" not in StrategyRegistry:
        DappleStrategy.register_strategies(StrategyRegistry)
