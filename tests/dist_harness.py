"""The tests' launcher is the package's (``lightning_dapple.execute.launch``); re-exported here
so test modules import it by one short name."""
from __future__ import annotations

from lightning_dapple.execute.launch import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
