"""Failure propagation of ``execute/failure.py`` on real gloo ranks, without a Trainer.

Rank 0 blocks in a receive from rank 1, and rank 1 fails in the three ways that matter:
it raises and exits (rank 0 must raise rank 1's message at once), it reports and stays
alive (rank 0's watchdog must end rank 0 within ``grace_s``), or it goes silent without
reporting (rank 0 must give up after ``timeout_s`` with a message naming the wait).
"""
from __future__ import annotations

import time

import pytest
import torch

from dist_harness import run_ranks


def blocked_receiver(rank: int, world: int, scenario: str) -> dict:
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel

    channel = FailureChannel(rank, timeout_s=3.0 if scenario == "silent" else 60.0, poll_s=0.1, grace_s=1.0)
    dist.barrier()
    if rank == 1:
        if scenario == "silent":
            time.sleep(8)  # alive, never sends, never reports
            return {}
        error = RuntimeError(f"deliberate {scenario} failure")
        channel.report(error)
        if scenario == "raises":
            raise error
        time.sleep(30)  # reported, but stuck: does not exit
        return {}
    start = time.monotonic()
    try:
        channel.wait(dist.irecv(torch.zeros(4), 1), "activation 0")
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - start}
    return {"error": None}


@pytest.mark.timeout(60)
def test_peer_that_raises_stops_the_waiting_rank_with_its_message() -> None:
    results = run_ranks(blocked_receiver, 2, "raises", timeout_s=45)
    assert "deliberate raises failure" in results["__errors__"][1]
    got = results[0]
    assert got["error"].startswith("PeerFailedError: rank 1 raised RuntimeError: deliberate raises failure"), got
    assert got["after_s"] < 10


@pytest.mark.timeout(60)
def test_peer_that_reports_but_hangs_ends_the_waiting_rank_within_grace() -> None:
    start = time.monotonic()
    results = run_ranks(blocked_receiver, 2, "stuck", timeout_s=45)
    assert "died with exit code 1" in results["__errors__"][0]  # the watchdog ended it
    assert time.monotonic() - start < 25  # rank 1 alone would have slept 30 s


@pytest.mark.timeout(60)
def test_silent_peer_times_out_naming_the_wait() -> None:
    results = run_ranks(blocked_receiver, 2, "silent", timeout_s=45)
    got = results[0]
    assert got["error"].startswith("CommTimeoutError: rank 0: no progress for 3 s while waiting for activation 0"), got
    assert 2.5 < got["after_s"] < 8.5
