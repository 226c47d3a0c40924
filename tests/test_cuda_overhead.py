"""The executor-overhead probe on a GPU: what ``plan="auto"`` runs at set-up on a CUDA rank.

Skipped where torch sees no CUDA device (CI); ``bash scripts/gpu_check.sh`` runs it.
"""
from __future__ import annotations

import math

import pytest
import torch

from lightning_dapple.execute.overhead_probe import LoopbackWire, measure_action_overhead
from lightning_dapple.execute.transfer.transport import Peer, Transport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_probe_measures_every_kind_on_a_gpu() -> None:
    state = torch.cuda.get_rng_state()
    values = measure_action_overhead("cuda", repeats=3, warmup=1).to_dict()
    assert all(math.isfinite(ms) and ms >= 0 for ms in values.values()), values
    assert torch.equal(torch.cuda.get_rng_state(), state)  # the probe leaves the GPU's RNG as it was


def test_loopback_wire_delivers_gpu_tensors() -> None:
    device = torch.device("cuda")
    transport = Transport(None, device, wire=LoopbackWire(device))  # type: ignore[arg-type]
    peers = [Peer(1, (0, 4))]
    for _ in range(2):  # the first transfer sends the layout, the second is the steady state
        value = torch.randn(4, 6, device=device, requires_grad=True)
        transport.send_activation(value, (0, 4), peers, "x")
        transport.flush()
        got = transport.recv_activation((0, 4), peers, "x")
        assert got.device.type == "cuda" and torch.equal(got, value.detach()) and got.requires_grad
