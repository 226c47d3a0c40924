"""Bad data in the middle of a run: a batch of the wrong shape or dtype, a NaN loss, a
short last batch. Every rank stops with the same one-line error naming the step and what
to change, within the job's timeout, and the last good checkpoint stays the last one."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from scripts.reliability_launch import drain, start

TWO_STAGES = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
TIMEOUT_S = 30
CASES = {
    "shape": (2, r"DappleConfigError: batch of training step 2 \(batch 2 of the epoch\): has \[1\] of dtype torch.float64 and per-sample shape \[7\], the first batch had torch.float64 and \[6\]\. Fix: make every batch's \[1\]|"
              r"DappleConfigError: batch of training step 2 \(batch 2 of the epoch\): has \[0\] of dtype torch.float64 and per-sample shape \[7\], the first batch had torch.float64 and \[6\]\. Fix: make every batch's \[0\]"),
    "dtype": (2, r"DappleConfigError: batch of training step 2 \(batch 2 of the epoch\): has \[0\] of dtype torch.int64 .* Fix: make every batch's \[0\] torch.float64"),
    "nan": (2, r"NonFiniteLossError: loss of training step 2 \(batch 2 of the epoch\): is nan; no parameter was updated\. Fix: check that batch"),
    "short": (3, r"DappleConfigError: batch of training step 3 \(batch 3 of the epoch\): has 1 samples, fewer than the plan's 3 micro-batches x 1 replicas\. Fix: use DataLoader\(drop_last=True\)"),
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", list(CASES))
def test_bad_batch_stops_every_rank_with_one_line_and_keeps_the_last_checkpoint(tmp_path: Path, kind: str) -> None:
    step, expected = CASES[kind]
    cfg = {"plan": TWO_STAGES, "devices": 2, "steps": 4, "batches": 4, "timeout_s": TIMEOUT_S, "bad": {"step": step, "kind": kind}, "ckpt": {"every": 1, "last": True}}
    job = start(cfg, tmp_path)
    try:
        codes, text, _ = job.wait(150)
        left = drain(job, 150)
    finally:
        job.kill()
    assert codes[0] not in (0, None) and not left, text[-3000:]
    # every rank finds the same bad batch; the run says so once (strategy/reporting.py)
    lines = [line for line in text.splitlines() if line.startswith("lightning_dapple: error:")]
    assert len(lines) == 1 and re.search(expected, lines[0]), text[-3000:]
    directory = tmp_path / "ckpt"
    last = torch.load(directory / "last.ckpt", weights_only=False)
    assert last["global_step"] == step  # the steps before the bad one, no later
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    assert sorted(p.name for p in directory.iterdir()) == sorted(["last.ckpt", *(f"epoch=0-step={s}.ckpt" for s in range(1, step + 1))])
    stopped_after = job_end(tmp_path) - (directory / "last.ckpt").stat().st_mtime
    assert stopped_after < TIMEOUT_S, stopped_after


def job_end(out: Path) -> float:
    """When the job's last output was written (its log closes with its last process)."""
    return max(p.stat().st_mtime for p in out.glob("log*.txt"))


class _Strategy:
    """What the checks read of the strategy: the plan and the trainer's step."""

    def __init__(self, plan) -> None:
        from types import SimpleNamespace

        self.plan = plan
        self.lightning_module = SimpleNamespace(trainer=SimpleNamespace(global_step=5))


@pytest.mark.timeout(30)
def test_the_checks_name_the_step_and_pass_good_batches() -> None:
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.strategy.batch_guard import NonFiniteLossError, check_training_batch, check_training_loss

    strategy = _Strategy(plan_from_dict({**TWO_STAGES, "stages": [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2]}]}))
    good = (torch.zeros(12, 6, dtype=torch.float64), torch.zeros(12, 3, dtype=torch.float64))
    check_training_batch(strategy, good, 0)  # the first batch sets the layout
    check_training_batch(strategy, (good[0][:6], good[1][:6]), 1)  # a short batch the plan can still slice
    check_training_loss(strategy, torch.tensor(0.5), 1)
    bad = {
        "dtype torch.float32": (good[0].float(), good[1]),
        r"per-sample shape \[3, 2\]": (good[0], good[1].view(12, 3, 1).expand(12, 3, 2)),
        "has the structure": [good[0], good[1]],
        r"5 samples, fewer than the plan's 3 micro-batches x 2 replicas": (good[0][:5], good[1][:5]),
        "13 samples, more than the plan's global batch of 12": (torch.zeros(13, 6, dtype=torch.float64), torch.zeros(13, 3, dtype=torch.float64)),
    }
    for problem, batch in bad.items():
        with pytest.raises(DappleConfigError, match=r"^batch of training step 5 \(batch 7 of the epoch\): .*" + problem):
            check_training_batch(strategy, batch, 7)
    for value in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteLossError, match=r"^loss of training step 5 \(batch 7 of the epoch\): is (nan|inf); no parameter was updated"):
            check_training_loss(strategy, torch.tensor(value, dtype=torch.float64), 7)
