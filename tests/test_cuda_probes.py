"""What ``plan="auto"`` measures at set-up on a CUDA rank besides the layers: the run
optimizer's step per layer, and the links between ranks that share one GPU over gloo.

Skipped where torch sees no CUDA device (CI); ``bash scripts/gpu_check.sh`` runs it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dapple.cluster import Cluster
from lightning_dapple.execute.collective_probe import with_measured_links
from lightning_dapple.profile.optimizer_step import measure_optimizer_ms

from dist_harness import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_optimizer_is_timed_on_the_gpu_and_the_layers_go_back_unchanged() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))
    before = [p.detach().clone() for p in layers.parameters()]
    times = measure_optimizer_ms(list(layers), lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1), device="cuda")
    assert times[0] > 0 and times[1] == 0.0 and times[2] > 0
    for value, param in zip(before, layers.parameters()):
        assert param.device.type == "cpu" and param.grad is None and torch.equal(value, param.detach())


def _links_on_a_shared_gpu(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    return with_measured_links(Cluster(1, world), torch.device("cuda", 0)).to_dict()


def test_ranks_sharing_a_gpu_over_gloo_measure_their_links_in_host_memory() -> None:
    results = run_ranks(_links_on_a_shared_gpu, 2, timeout_s=180, raise_on_error=True)
    assert results[0] == results[1]
    assert results[0]["allreduce_latency_ms"] > 0 and results[0]["latency_ms"] > 0
