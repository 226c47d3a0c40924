"""Lightning glue: the DappleStrategy and its registration as "dapple" / "dapple_spawn"."""
from lightning_dapple.strategy.dapple_strategy import DappleStrategy

__all__ = ["DappleStrategy"]
