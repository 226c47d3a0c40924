"""Waits outside the failure channel's own methods are watched too (execute/failure.py): a
rank blocked in one while its peer has failed ends within the channel's grace, not the
process group's timeout.

Two gloo ranks. The failing rank publishes its error and stays alive (a rank stuck in its
own teardown), so nothing wakes the other: only the watchdog can end it. The waits are
those the desk review of the NCCL paths listed, each shown here through its CPU path: a
BatchNorm's statistics across replicas (``execute/batchnorm.py``), a process group being
made (``execute/process_groups.py``; under NCCL a communicator split with no timeout of its
own), and Lightning's per-batch SIGTERM broadcast (``strategy/reporting.py``).
"""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from dist_harness import run_ranks
from lightning_dapple.execute.launch import ERRORS_KEY

GRACE_S = 2.0
GROUP_TIMEOUT_S = 60.0  # the process group's: what an unwatched wait would last
FAILING = {"batchnorm": 1, "subgroup": 1, "sigterm": 0}  # rank 0 serves the store: it fails where the other must receive


def _blocked_worker(rank: int, world: int, mode: str) -> str:
    import torch.distributed as dist
    from torch import nn

    from lightning_dapple.execute.batchnorm import StageBuffers, convert_batchnorm
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.process_groups import subgroup

    failure = FailureChannel(rank, timeout_s=GROUP_TIMEOUT_S, grace_s=GRACE_S, poll_s=0.1)
    failing = rank == FAILING[mode]
    layers = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    if mode == "batchnorm":
        group = subgroup([0, 1])  # before the failure: both ranks make it
        convert_batchnorm(layers, list(layers), group, rank, 2, sync=True, deferred=False)
        StageBuffers(list(layers), group, 0, rank, 2, failure, 0)  # gives the statistics the channel
    loop = _watched_loop() if mode == "sigterm" else None  # set up before the failure, as the strategy does
    dist.barrier()
    if failing:
        time.sleep(1.5)  # the other rank blocks first (a report known before a wait raises at once)
        failure.report(RuntimeError("stage 1 failed"))
        time.sleep(GROUP_TIMEOUT_S)  # alive, silent on every collective
        return "the failing rank woke up"
    if mode == "batchnorm":
        layers(torch.randn(5, 3, dtype=torch.float64))
    elif mode == "subgroup":
        subgroup([0, 1])
    else:
        loop._broadcast_sigterm_tensor()
    return "returned"


def _watched_loop() -> Any:
    """A loop doing what Lightning 2.6's training epoch loop does before every batch,
    watched as the strategy watches Lightning's."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from lightning_dapple.strategy.reporting import watch_for_lightning_waits

    class Loop:
        def _broadcast_sigterm_tensor(self) -> None:
            dist.broadcast(torch.zeros(1), src=0)

    loop = Loop()
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop), strategy=SimpleNamespace(root_device=torch.device("cpu")))
    watch_for_lightning_waits(trainer)
    return loop


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(FAILING))
def test_a_rank_blocked_outside_the_channels_waits_ends_within_the_grace(mode: str, capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    results: dict[Any, Any] = run_ranks(_blocked_worker, 2, mode, timeout_s=GROUP_TIMEOUT_S)
    elapsed = time.monotonic() - started
    blocked = 1 - FAILING[mode]
    errors = results.get(ERRORS_KEY, {})
    assert errors.get(blocked, "").startswith(f"rank {blocked} died with exit code 1"), results
    # process starts and the group's set-up included; an unwatched wait lasts GROUP_TIMEOUT_S
    assert elapsed < 40, elapsed
    said = capfd.readouterr().err
    assert f"rank {FAILING[mode]} raised RuntimeError: stage 1 failed (seen on rank {blocked}, blocked {GRACE_S:.0f} s in" in said, said
