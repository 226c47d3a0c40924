"""Resume equals never stopping. A run of 2N steps writes a checkpoint at step N (what a
run stopped at N leaves); a fresh job resumed from it and run to 2N must end where the
uninterrupted run ended: parameters, Adam state, LR scheduler, dropout masks and the data
position (mid-epoch, shuffled: ResumableDataLoader), in float64 to 1e-10, with
out-of-order backprop and recomputation on. Resumed under other plans (another stage
split and M, or data parallelism instead of a pipeline) it continues the same loss
sequence (to 1e-8; no dropout there: masks are drawn per stage and replica)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scripts.reliability_launch import start

N = 4  # 3 batches an epoch: step N is inside epoch 1
PIPE = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
OTHER_SPLIT = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, 5], "devices": [1]}]}
DATA_PARALLEL = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}
COMMON = {"devices": 2, "steps": 2 * N, "batches": 3, "resumable": True, "scheduler": True, "final": True, "strategy": {"recompute": "always", "ooo": True}}


def _run(out: Path, **cfg) -> Path:
    job = start({**COMMON, **cfg}, out)
    try:
        codes, text, _ = job.wait(200)
    finally:
        job.kill()
    assert codes == [0], text[-4000:]
    return out


def _losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


def _at_step(out: Path, step: int) -> Path:
    return next(p for p in (out / "ckpt").iterdir() if f"step={step}" in p.name)


def _max_diff(a, b) -> float:
    """Largest difference between two nested structures of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        return float((a.double() - torch.as_tensor(b).double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(a), sorted(b))
        return max([_max_diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max([_max_diff(x, y) for x, y in zip(a, b)] or [0.0])
    if isinstance(a, float):
        return abs(a - b)
    assert a == b, (a, b)
    return 0.0


@pytest.mark.timeout(300)
def test_resume_with_dropout_ooo_and_recompute_equals_never_stopping(tmp_path: Path) -> None:
    full = _run(tmp_path / "full", plan=PIPE, dropout=0.2, ckpt={"every": N})
    resumed = _run(tmp_path / "resumed", plan=PIPE, dropout=0.2, resume=str(_at_step(full, N)))
    a = torch.load(full / "final.ckpt", weights_only=False)
    b = torch.load(resumed / "final.ckpt", weights_only=False)
    assert (a["global_step"], b["global_step"]) == (2 * N, 2 * N)
    assert _max_diff(a["state_dict"], b["state_dict"]) < 1e-10
    assert _max_diff(a["optimizer_states"], b["optimizer_states"]) < 1e-10
    assert a["lr_schedulers"] == b["lr_schedulers"] and a["lr_schedulers"][0]["_last_lr"] == [0.01 * 0.5**4]
    assert b["loops"]["fit_loop"]["state_dict"]["combined_loader"] == a["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    first, second = _losses(full), _losses(resumed)
    assert sorted(second) == list(range(N + 1, 2 * N + 1))
    assert [second[s] for s in sorted(second)] == pytest.approx([first[s] for s in sorted(second)], abs=1e-10)


@pytest.mark.timeout(400)
def test_resume_under_other_plans_continues_the_same_losses(tmp_path: Path) -> None:
    full = _run(tmp_path / "full", plan=PIPE, ckpt={"every": N})
    first = _losses(full)
    a = torch.load(full / "final.ckpt", weights_only=False)
    for name, plan in (("other-split-and-M", OTHER_SPLIT), ("data-parallel", DATA_PARALLEL)):
        resumed = _run(tmp_path / name, plan=plan, resume=str(_at_step(full, N)))
        second = _losses(resumed)
        assert sorted(second) == list(range(N + 1, 2 * N + 1)), name
        assert [second[s] for s in sorted(second)] == pytest.approx([first[s] for s in sorted(second)], abs=1e-8), name
        b = torch.load(resumed / "final.ckpt", weights_only=False)
        assert _max_diff(a["state_dict"], b["state_dict"]) < 1e-8, name


@pytest.mark.timeout(300)
def test_resume_of_a_float32_module_under_64_true_loses_nothing(tmp_path: Path) -> None:
    """Users leave the module in float32 and let precision="64-true" convert it; a resumed
    run must load the float64 checkpoint into the converted module, not round it through
    float32 first."""
    full = _run(tmp_path / "full", plan=PIPE, ckpt={"every": N}, double=False)
    resumed = _run(tmp_path / "resumed", plan=PIPE, resume=str(_at_step(full, N)), double=False)
    a = torch.load(full / "final.ckpt", weights_only=False)
    b = torch.load(resumed / "final.ckpt", weights_only=False)
    assert _max_diff(a["state_dict"], b["state_dict"]) < 1e-10
