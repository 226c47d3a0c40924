"""Trainer(strategy=dapple): real Lightning loops on 4 CPU processes, against plain training.

Each test launches processes (seconds each on two cores), so one launch checks several
things: parameters, logged losses, validation logging, checkpoints.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import ExitCleanupProbe, LossRecorder, MLPModule, assert_trained_like_one_device, mlp_loader, single_device_run

TWO_BY_TWO = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2, 3]}]}


def _trainer(tmp_path: Path, plan, devices: int, steps: int, **kwargs) -> Trainer:
    strategy = DappleStrategy(plan=plan, start_method="spawn", timeout_s=60, **kwargs.pop("strategy_kwargs", {}))
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision="64-true",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


@pytest.mark.timeout(300)
def test_fit_matches_single_device_and_logs_global_loss(tmp_path: Path) -> None:
    model = MLPModule().double()
    best = ModelCheckpoint(dirpath=str(tmp_path / "best"), monitor="val_loss", mode="min")
    stop = EarlyStopping(monitor="val_loss", patience=10)
    probe = ExitCleanupProbe(str(tmp_path))
    trainer = _trainer(tmp_path, TWO_BY_TWO, 4, 3, gradient_clip_val=0.5, limit_val_batches=1, val_check_interval=3, callbacks=[best, stop, probe])
    trainer.fit(model, mlp_loader(3), mlp_loader(1))
    assert Path(best.best_model_path).is_file()  # monitored a metric logged on the last stage
    losses, expected_val = assert_trained_like_one_device(model, trainer)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(losses[-1], abs=1e-10)
    assert float(trainer.callback_metrics["val_mse"]) == pytest.approx(expected_val, abs=1e-6)  # torchmetrics
    plan = json.loads((tmp_path / "dapple_plan.json").read_text())
    assert [s["warmup"] for s in plan["stages"]] == [2, 1]
    assert plan["ooo"] is True and plan["extra"]["ooo_choice"].startswith("on (auto: 2 stages")  # ooo="auto" default
    # gloo's worker threads (which own every collective's Work) must not outlive the exit
    # handler: one dropping a tensor during interpreter finalization aborts the process.
    for rank in range(4):
        exit_state = json.loads((tmp_path / f"exit_rank{rank}.json").read_text())
        assert exit_state["registered"] == [True]  # the strategy, held weakly
        assert "pt_gloo_runloop" in exit_state["before"]
        assert "pt_gloo_runloop" not in exit_state["after"], exit_state


def _plan_straight(cuts: list[int], layers: int = 5) -> dict:
    edges = [0, *cuts, layers]
    return {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [a, b], "devices": [i]} for i, (a, b) in enumerate(zip(edges, edges[1:]))]}


@pytest.mark.timeout(600)
def test_checkpoint_resumes_under_other_plans(tmp_path: Path) -> None:
    """A checkpoint of a 2-stage run continues identically under the same plan, under DP
    on 2 and under 4 stages (Adam state keyed by parameter name moves between plans).

    The checkpoint is written at the end of epoch 0; Lightning resumes a plain
    DataLoader by restarting it, so the continuation is compared between plans (and its
    first loss with the uninterrupted run, which shows the weights were restored)."""
    first = tmp_path / "first"
    checkpoints = ModelCheckpoint(dirpath=str(first / "ckpt"), every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1)
    trainer = _trainer(first, _plan_straight([2]), 2, 6, callbacks=[checkpoints, LossRecorder(str(first / "losses.json"))], gradient_clip_val=0.5)
    trainer.fit(MLPModule().double(), mlp_loader(3))
    curve = {int(k): v for k, v in json.loads((first / "losses.json").read_text()).items()}
    assert [curve[s] for s in range(1, 7)] == pytest.approx(single_device_run(3, clip=0.5, epochs=2)[1], abs=1e-10)
    checkpoint = next(p for p in (first / "ckpt").iterdir() if "step=3" in p.name)
    saved = torch.load(checkpoint, weights_only=False)
    MLPModule().double().load_state_dict(saved["state_dict"])  # strict: original keys, loadable without dapple
    assert not [p for p in (first / "ckpt").iterdir() if p.name.endswith(".tmp")]

    plans = {
        "same": (_plan_straight([2]), 2),
        "dp2": ({"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}, 2),
        "four": (_plan_straight([1, 2, 4]), 4),
    }
    continuations = {}
    for name, (plan, devices) in plans.items():
        out = tmp_path / name
        resumed = _trainer(out, plan, devices, 6, callbacks=[LossRecorder(str(out / "losses.json"))], gradient_clip_val=0.5, enable_checkpointing=False)
        resumed.fit(MLPModule().double(), mlp_loader(3), ckpt_path=str(checkpoint))
        again = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
        continuations[name] = [again[s] for s in sorted(again)]
    assert len(continuations["same"]) == 3
    assert continuations["same"][0] == pytest.approx(curve[4], abs=1e-10)
    for name in ("dp2", "four"):
        assert continuations[name] == pytest.approx(continuations["same"], abs=1e-10), name


@pytest.mark.timeout(300)
def test_failure_on_one_rank_stops_all_with_its_message(tmp_path: Path) -> None:
    model = MLPModule(fail_at_step=1, fail_rank=3)
    trainer = _trainer(tmp_path, TWO_BY_TWO, 4, 3, enable_checkpointing=False)
    start = time.monotonic()
    with pytest.raises(Exception, match="deliberate failure at step 1"):
        trainer.fit(model, mlp_loader(3))
    assert time.monotonic() - start < 60


@pytest.mark.timeout(300)
def test_subprocess_launcher_from_a_script(tmp_path: Path) -> None:
    script = Path(__file__).parent / "scripts" / "train_with_dapple.py"
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out.json")], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    reference, losses = single_device_run(3, clip=0.5)
    assert got["max_diff"] < 1e-10
    assert got["loss"] == pytest.approx(losses[-1], abs=1e-10)
    assert got["prediction_batches"] == 2 and got["prediction_diff"] < 1e-12  # in order, all rows
