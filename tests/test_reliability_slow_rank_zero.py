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


# -- a checkpoint's parts: each leader waits for its turn as long as rank 0 progresses ----------

PART_TIMEOUT_S = 2.0
PART_TENSORS = 6
TAKE_S = 0.4  # rank 0's time per tensor taken: rank 1's part takes it about 3 s, > PART_TIMEOUT_S


def _parts_worker(rank: int, world: int, mode: str) -> dict | str:
    """Stage leaders 1 and 2 send their parts to rank 0 (``checkpoint.consolidated_state_dict``
    over ``PartTurns``). ``slow``: rank 0 takes every tensor slowly, so rank 2 waits for its
    turn longer than ``timeout_s``; ``stalled``: rank 0 takes nothing for 3 x ``timeout_s``."""
    import time

    import torch
    from torch import nn

    from lightning_dapple.execute.failure import CommTimeoutError, FailureChannel
    from lightning_dapple.strategy import checkpoint as ckpt
    from lightning_dapple.strategy.part_stream import PartLane

    class SlowTurns(ckpt.PartTurns):
        def __call__(self, work, what: str) -> None:
            super().__call__(work, what)
            time.sleep(TAKE_S)

    failure = FailureChannel(rank, timeout_s=PART_TIMEOUT_S, poll_s=0.1)
    module = nn.Module()
    for index in range(PART_TENSORS):
        module.register_buffer(f"part{rank}_{index}", torch.full((1000,), float(10 * rank + index), dtype=torch.float64))
    layout = ckpt.CheckpointLayout(
        key_owner={f"part{r}_{i}": r for r in range(world) for i in range(PART_TENSORS)},
        parameter_names=[], stage_leaders=tuple(range(world)), global_rank=rank,
    )
    turns = SlowTurns(failure) if rank == 0 else ckpt.PartTurns(failure)
    started = time.monotonic()
    try:
        if rank == 0 and mode == "stalled":
            time.sleep(3 * PART_TIMEOUT_S)
        state = ckpt.consolidated_state_dict(module, layout, PartLane(None, turns))
    except CommTimeoutError as exc:
        return f"{time.monotonic() - started:.1f} s: {exc}"
    finally:
        failure.close()
    return {key: float(value[0]) for key, value in state.items()}


@pytest.mark.timeout(120)
def test_a_checkpoint_part_waits_its_turn_as_long_as_rank_zero_takes_parts() -> None:
    """Rank 2's turn comes about 3 s after the save starts, with ``timeout_s=2``: every part
    still arrives (a leader's deadline restarts while rank 0 makes progress)."""
    from dist_harness import run_ranks

    results = run_ranks(_parts_worker, 3, "slow", timeout_s=90)
    assert "__errors__" not in results, results
    expected = {f"part{r}_{i}": float(10 * r + i) for r in range(3) for i in range(PART_TENSORS)}
    assert results[0] == expected
    assert results[1] == {} and results[2] == {}


@pytest.mark.timeout(120)
def test_a_leader_whose_turn_never_comes_fails_after_the_timeout() -> None:
    """Rank 0 takes nothing: the first leader stops ``timeout_s`` after the save began, saying
    that rank 0 made no progress."""
    from dist_harness import run_ranks

    results = run_ranks(_parts_worker, 3, "stalled", timeout_s=90)
    said = results.get(1, "")
    assert isinstance(said, str) and "rank 0 took no checkpoint part for 2 s" in said, results
    assert float(said.split(" s:")[0]) < 2 * PART_TIMEOUT_S + 2, said
