"""Test-wide isolation of torch.distributed state.

Lightning's single-device runs initialise a process group in the pytest process and pin
MASTER_PORT in the environment; spawned runs would then inherit the port (already bound
by this process's store) and fail with EADDRINUSE. Every test starts with no process group
and, unless it sets one, a fresh free port.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from dist_harness import free_port  # noqa: E402


def shared_profiles() -> Path:
    """shared/profiles beside the checkout (as CI clones it), else the workplace copy."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "profiles"
    return beside if beside.is_dir() else Path("/work/shared/profiles")


@pytest.fixture(autouse=True)
def _isolated_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        os.environ.pop(key, None)
