"""The transport's wires on real GPUs: pinned staging over gloo with ranks sharing one GPU,
and NCCL's batched p2p on communication streams (execute/wires.py, execute/staging.py).

Skipped where torch sees no CUDA device (CI runs the same code paths forced over gloo on
CPU: tests/test_transport_backends.py); run them on a GPU machine with
``pytest tests/test_cuda_transport.py``.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from dist_harness import free_port, run_ranks
from test_transport_backends import GRADIENTS, STEPS, train_worker, worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(300)
def test_ranks_sharing_one_gpu_stage_through_pinned_buffers() -> None:
    """gloo with CUDA tensors (the one-GPU machine): the automatic wire is ``staged``, its
    host buffers are pinned and reused, and every dtype and layout round-trips over a
    2 -> 3 split boundary."""
    results = run_ranks(worker, 5, ("auto",), "cuda:0", timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(5):
        got = results[rank]["auto"]
        assert got["name"] == "staged" and got["pinned"], got
        assert got["checked"] == STEPS if rank >= 2 else got["gradients"] == len(GRADIENTS)
        assert got["allocated"][-1] == got["allocated"][-2], got["allocated"]  # the repeat reused its buffers


def _train_on_gpu(rank: int, world: int) -> dict[str, Any]:
    return train_worker(rank, world, device="cuda:0", wires=("auto",))


@pytest.mark.timeout(300)
def test_training_on_one_shared_gpu_matches_single_process() -> None:
    results = run_ranks(_train_on_gpu, 3, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(3):
        assert results[rank]["auto"]["name"] == "staged"
        assert results[rank]["auto"]["reference_diff"] < 1e-8, results[rank]["auto"]["reference_diff"]


def _nccl_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """Swap the harness's gloo group for NCCL (one GPU per rank), run the round trips with
    the automatic wire, and leave NCCL as the default group for the harness's barrier."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.destroy_process_group()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120),
        device_id=torch.device("cuda", rank),
    )
    senders = tuple(range(world // 2))
    receivers = tuple(range(world // 2, world))
    return worker(rank, world, ("auto",), f"cuda:{rank}", senders, receivers)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_batched_p2p_round_trips_every_dtype() -> None:
    world = min(torch.cuda.device_count(), 5)
    results = run_ranks(_nccl_worker, world, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(world):
        got = results[rank]["auto"]
        assert got["name"] == "nccl" and not got["short"] and not got["ahead"], got
        if rank >= world // 2:
            assert got["checked"] == STEPS and not any(got["posted"])
        else:
            assert got["gradients"] == len(GRADIENTS)
