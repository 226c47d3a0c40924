"""Rank 0 working alone for longer than ``timeout_s`` is waited for; rank 0 dying meanwhile
ends the job.

While rank 0 profiles and plans (``plan="auto"``) or writes a checkpoint, the other ranks
wait for it in the store (``execute/store_sync.py``) rather than in a process-group
collective, whose timeout is ``timeout_s``: its work may take as long as it takes, as under
DDP, and its death still ends every rank at once. One real launch each, under Lightning's
subprocess launcher (where rank 0 also serves the job's store).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scripts.reliability_launch import drain, start


def _finish(job, limit_s: float) -> tuple[list[int | None], str, float]:
    try:
        codes, text, elapsed = job.wait(limit_s)
        left = drain(job, elapsed + 30)
    finally:
        job.kill()
    assert not left, f"processes left: {left}\n{text[-3000:]}"
    return codes, text, elapsed


@pytest.mark.timeout(300)
def test_rank_zero_planning_and_writing_a_checkpoint_longer_than_the_timeout(tmp_path: Path) -> None:
    """Rank 0 spends 10 s alone inside planning and 10 s inside the checkpoint write, with
    ``timeout_s=8`` (peers silent for 4 s count as stopped: room for a loaded machine's
    scheduling): the job trains to the end and saves."""
    cfg = {"plan": "auto", "devices": 2, "steps": 4, "batches": 4, "timeout_s": 8, "slow_rank_zero": 10, "ckpt": {"every": 4}}
    codes, text, elapsed = _finish(start(cfg, tmp_path), 240)
    assert codes == [0], text[-3000:]
    assert elapsed > 20, elapsed  # both waits really outlasted timeout_s
    assert sorted(json.loads((tmp_path / "losses.json").read_text())) == ["1", "2", "3", "4"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["epoch=0-step=4.ckpt"]
    assert "lightning_dapple: error" not in text and "Timed out" not in text, text[-3000:]


@pytest.mark.timeout(300)
def test_rank_zero_dying_while_it_plans_ends_every_rank_with_its_name(tmp_path: Path) -> None:
    cfg = {"plan": "auto", "devices": 2, "steps": 2, "batches": 2, "timeout_s": 60, "kill_planning": True}
    job = start(cfg, tmp_path)
    drain(job, 120)
    codes, text, elapsed = _finish(job, 5)
    assert elapsed < 60, text[-3000:]  # not the 60 s timeout: the dead store host is seen at once
    assert all(code not in (0, None) for code in codes), (codes, text[-3000:])
    # rank 1 waits for the plan, or (when it lags) for Lightning's broadcast just before it
    assert re.search(r"rank 0, which serves it .*; rank 1 was waiting for .* from rank 0", text), text[-3000:]


def _limit_worker(rank: int, world: int) -> str:
    from lightning_dapple.execute.failure import CommTimeoutError, FailureChannel

    failure = FailureChannel(rank, timeout_s=10)
    try:
        failure.wait_until(lambda: False, "a key no rank writes", limit_s=1.0)
    except CommTimeoutError as exc:
        return str(exc)
    finally:
        failure.close()
    return "returned"


@pytest.mark.timeout(60)
def test_a_store_wait_that_no_rank_answers_ends_at_its_limit() -> None:
    """Every peer beats but none writes what this rank waits for (a collective skipped on
    one rank): the wait ends at its limit (Lightning's 30 minutes by default) with what it
    waited for, instead of forever."""
    from dist_harness import run_ranks

    results = run_ranks(_limit_worker, 2, timeout_s=45)
    for rank in (0, 1):
        assert results[rank].startswith(f"rank {rank}: waited 1 s for a key no rank writes while every peer kept beating"), results
