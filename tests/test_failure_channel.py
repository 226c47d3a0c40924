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


def dying_peer(rank: int, world: int, scenario: str, out: str) -> dict:
    """Rank 1 dies without a word (``killed``) or goes silent with its heartbeat stopped
    (``stopped``: what a SIGSTOPped process looks like to its peers); rank 0 waits on it
    and writes what it saw to ``out`` (run_ranks stops collecting once a rank is dead)."""
    import json
    import os
    import signal

    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel

    channel = FailureChannel(rank, timeout_s=30.0, poll_s=0.1, heartbeat_s=0.25, unresponsive_s=2.0)
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        if scenario in ("killed", "lost-connection"):
            os.kill(os.getpid(), signal.SIGKILL)
        channel.close()  # no more heartbeats; the connection stays open
        time.sleep(6)
        return {}
    start = time.monotonic()
    if scenario == "lost-connection":  # a send posted to the dead peer raised, outside any wait
        time.sleep(2)
        channel.report(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242"))
        with open(out, "w") as stream:
            json.dump({"published": channel._read_report()}, stream)
        return {}
    try:
        channel.wait(dist.irecv(torch.zeros(4), 1), "activation 0 from rank 1")
        got = {"error": None}
    except Exception as exc:
        got = {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - start}
    with open(out, "w") as stream:
        json.dump(got, stream)
    return got


@pytest.mark.timeout(60)
def test_killed_peer_is_named_at_once(tmp_path) -> None:
    import json

    out = tmp_path / "rank0.json"
    results = run_ranks(dying_peer, 2, "killed", str(out), timeout_s=45)
    assert 1 not in results  # it never reported
    got = json.loads(out.read_text())
    assert got["error"].startswith("PeerFailedError: rank(s) [1] died without reporting an error"), got
    assert got["after_s"] < 5


@pytest.mark.timeout(60)
def test_a_rank_reporting_a_lost_connection_names_the_dead_peer_not_itself(tmp_path) -> None:
    import json

    out = tmp_path / "rank0.json"
    run_ranks(dying_peer, 2, "lost-connection", str(out), timeout_s=45)
    published = json.loads(out.read_text())["published"]
    assert published.startswith("rank(s) [1] died without reporting an error (killed or crashed); rank 0 was waiting for a transfer"), published


@pytest.mark.timeout(60)
def test_silent_peer_is_reported_by_the_watchdog_within_unresponsive_s(tmp_path, capfd) -> None:
    start = time.monotonic()
    results = run_ranks(dying_peer, 2, "stopped", str(tmp_path / "rank0.json"), timeout_s=45)
    assert "died with exit code 1" in results["__errors__"][0]  # the watchdog ended it
    assert time.monotonic() - start < 20  # its wait's timeout is 30 s
    lines = [line for line in capfd.readouterr().err.splitlines() if "stopped responding" in line]
    assert len(lines) == 1 and lines[0].startswith("lightning_dapple: rank(s) [1] stopped responding"), lines
    assert not (tmp_path / "rank0.json").exists()  # rank 0 never got past its blocked wait


def first_report_wins(rank: int, world: int) -> str | None:
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel

    channel = FailureChannel(rank, timeout_s=30.0, poll_s=0.1)
    if rank == 0:
        channel.report(RuntimeError("root cause"))
    dist.barrier()
    if rank == 1:
        channel.report(RuntimeError("consequence"))
    dist.barrier()
    message = channel._read_report()
    channel.close()
    return message


@pytest.mark.timeout(60)
def test_the_first_published_failure_is_what_every_rank_reads() -> None:
    results = run_ranks(first_report_wins, 2, timeout_s=45, raise_on_error=True)
    assert results == {0: "rank 0 raised RuntimeError: root cause", 1: "rank 0 raised RuntimeError: root cause"}
