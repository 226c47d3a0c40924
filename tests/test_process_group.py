"""The default process group the strategy opens: ranks sharing one GPU talk over gloo, and a
gloo group bound to a GPU cannot make the replica groups that leave ranks out (torch 2.11
splits every ``new_group`` from a bound default group, which gloo cannot do for the ranks
outside it). So under gloo no device is bound; under NCCL the group opens as Lightning's DDP
opens it."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import ddp as lightning_ddp

from lightning_dapple.strategy import dapple_strategy
from lightning_dapple.strategy.dapple_strategy import DappleStrategy


def _opened_with(monkeypatch: pytest.MonkeyPatch, backend: str, strategy_class: type = DappleStrategy) -> dict[str, Any]:
    """The arguments ``strategy_class`` opens its default group with, on rank 1 of two sharing cuda:0."""
    calls: list[dict[str, Any]] = []

    def record(environment: Any, group_backend: str, **kwargs: Any) -> None:
        calls.append({"backend": group_backend, **kwargs})

    monkeypatch.setattr(dapple_strategy, "_init_dist_connection", record)
    monkeypatch.setattr(lightning_ddp, "_init_dist_connection", record)
    environment = LightningEnvironment()
    strategy = strategy_class(parallel_devices=[torch.device("cuda", 0)] * 2, process_group_backend=backend, cluster_environment=environment)
    strategy._local_rank = 1
    strategy.setup_distributed()
    assert len(calls) == 1
    return calls[0]


def test_gloo_ranks_sharing_a_gpu_bind_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = _opened_with(monkeypatch, "gloo")
    assert opened["backend"] == "gloo" and opened.get("device_id") is None
    assert opened["timeout"] is not None


def test_nccl_opens_the_group_as_lightnings_ddp_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL nothing changes: the device binding (Lightning >= 2.5 passes one) stays."""
    opened, lightnings = _opened_with(monkeypatch, "nccl"), _opened_with(monkeypatch, "nccl", DDPStrategy)
    assert opened["backend"] == "nccl" and opened.get("device_id") == lightnings.get("device_id")
