"""A rank that dies or stops mid-step ends the job: every other rank exits within 60 s,
non-zero, with a line naming that rank, and nothing is left behind (processes, shared
memory, the rendezvous port). Under Lightning's subprocess launcher and under torchrun.

Each case is one real launch (seconds on two cores), so the kill positions are spread
over the launchers instead of crossing them all: under Lightning's launcher a middle
stage, the last stage and rank 0 (which also hosts the job's store) are killed and a
middle stage is stopped; under torchrun a middle-stage rank on the second node is killed.
"""
from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest

from dist_harness import free_port
from scripts.reliability_launch import pid_alive, session_processes, start

THREE_STAGES = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 3], "devices": [1]}, {"layers": [3, 5], "devices": [2]}]}
# under torchrun: 2 nodes x 2; the middle stage's replicas are ranks 1 (node 0) and 2 (node 1)
FOUR_RANKS = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 3], "devices": [1, 2]}, {"layers": [3, 5], "devices": [3]}]}
EXIT_S = 60.0


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore binds
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run_until_gone(job, limit_s: float) -> float:
    """Seconds from the start until no process of the job is left (or ``limit_s``)."""
    while time.monotonic() - job.started < limit_s:
        if not session_processes(job):
            break
        time.sleep(0.2)
    return time.time()


def _kill_and_check(tmp_path: Path, launcher: str, victim: int, signal_name: str, timeout_s: float = 60) -> str:
    port = free_port()
    cfg = {"steps": 4, "batches": 4, "timeout_s": timeout_s, "kill": {"rank": victim, "step": 2, "signal": signal_name}}
    if launcher == "lightning":
        cfg.update(plan=THREE_STAGES, devices=3)
    else:
        cfg.update(plan=FOUR_RANKS, devices=2, num_nodes=2)
    shm_before = set(os.listdir("/dev/shm"))
    job = start(cfg, tmp_path, launcher, port=port)
    try:
        gone_at = _run_until_gone(job, 240)
        codes, text, _ = job.wait(5)
        left = session_processes(job)
    finally:
        job.kill()
    killed_at = float((tmp_path / "killed_at").read_text())
    pids = {int(p.name): p.read_text().split() for p in (tmp_path / "pids").iterdir()}
    assert not left, f"processes left: {left}\n{text[-3000:]}"
    assert gone_at - killed_at < EXIT_S, text[-3000:]
    print(f"{launcher} SIG{signal_name} of rank {victim}: every process gone {gone_at - killed_at:.1f} s after it")
    assert all(code not in (0, None) for code in codes), (codes, text[-3000:])
    assert not any(pid_alive(int(pid)) for pid, _ in pids.values())
    # a line names the dead rank: the failure channel's, or the launcher's when it ended the
    # job first (Lightning's child observer, every 5 s; torchrun's failure summary); no
    # line of the failure channel names another rank as the dead one
    deaths = [line for line in text.splitlines() if line.startswith("lightning_dapple:") and re.search("died|stopped responding|is gone", line)]
    named = rf"rank\(s\) \[[\d, ]*\b{victim}\b[\d, ]*\] (died without reporting|stopped responding)|rank {victim}, which serves it"
    assert all(re.search(named, line) for line in deaths), (deaths, text[-3000:])
    launchers = rf"\[rank: {victim}\] Child process with PID {pids[victim][0]} terminated|rank\s*: {victim} \(local_rank"
    assert deaths or re.search(launchers, text), text[-3000:]
    leaked = [name for name in set(os.listdir("/dev/shm")) - shm_before if any(pid in name for pid, _ in pids.values())]
    assert not leaked
    ports = {port} if launcher == "torchrun" else {int(p) for _, p in pids.values() if p.isdigit()}
    assert ports and all(_port_free(p) for p in ports)
    return text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 2, 0], ids=["middle-stage", "last-stage", "rank-0"])
def test_killed_rank_ends_the_job_under_lightnings_launcher(tmp_path: Path, victim: int) -> None:
    _kill_and_check(tmp_path, "lightning", victim, "KILL")


@pytest.mark.timeout(300)
def test_killed_rank_ends_the_job_under_torchrun(tmp_path: Path) -> None:
    _kill_and_check(tmp_path, "torchrun", 2, "KILL")


@pytest.mark.timeout(300)
def test_stopped_rank_is_reported_by_the_watchdog_within_its_timeout(tmp_path: Path) -> None:
    """SIGSTOP keeps the rank's connections open: nothing fails, its peers just wait. Their
    watchdogs see its heartbeat stop and end the job well before the 20 s wait timeout
    would (and end the stopped rank, which no launcher would reap)."""
    text = _kill_and_check(tmp_path, "lightning", 1, "STOP", timeout_s=20)
    assert "stopped responding: no heartbeat for 10 s" in text
