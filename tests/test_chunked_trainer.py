"""Trainer(strategy=DappleStrategy(plan=<chunked plan>)): 2 processes, interleaved 2 chunks.

One launch trains 6 steps (2 epochs) with clipping and validation, checkpoints at the end of
the first epoch and writes the measured timeline, compared with plain single-process
training; a second launch resumes from that checkpoint under the same plan, compared with a
plain single-process Lightning run resumed from the same file. All to 1e-10.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.app.callbacks import PipelineReport
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import LossRecorder, MLPModule, assert_trained_like_one_device, mlp_loader

# the MLP's 5 layers as 4 stages, stage k on rank k mod 2
INTERLEAVED = {
    "global_batch_size": 12,
    "micro_batches": 4,
    "schedule": "interleaved",
    "stages": [{"layers": [a, b], "devices": [k % 2]} for k, (a, b) in enumerate([(0, 1), (1, 2), (2, 4), (4, 5)])],
}


SINGLE = {"global_batch_size": 12, "micro_batches": 4, "stages": [{"layers": [0, 5], "devices": [0]}]}


def _trainer(root: Path, steps: int, plan: dict = INTERLEAVED, devices: int = 2, **kwargs) -> Trainer:
    return Trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=60),
        accelerator="cpu",
        devices=devices,
        precision="64-true",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        gradient_clip_val=0.5,
        **kwargs,
    )


@pytest.mark.timeout(600)
def test_a_chunked_plan_trains_checkpoints_and_resumes_like_one_device(tmp_path: Path) -> None:
    first = tmp_path / "first"
    checkpoints = ModelCheckpoint(dirpath=str(first / "ckpt"), every_n_epochs=1, save_on_train_epoch_end=True, save_top_k=-1)
    report = PipelineReport(str(first), cluster={}, table=False, simulated=False)
    trainer = _trainer(first, 6, callbacks=[checkpoints, LossRecorder(str(first / "losses.json")), report], limit_val_batches=1)
    model = MLPModule().double()
    trainer.fit(model, mlp_loader(3), mlp_loader(1))

    losses, _ = assert_trained_like_one_device(model, trainer, epochs=2)  # every chunk's layers gathered back
    curve = {int(k): v for k, v in json.loads((first / "losses.json").read_text()).items()}
    assert [curve[s] for s in range(1, 7)] == pytest.approx(losses, abs=1e-10)

    timeline = json.loads((first / "timeline_measured.json").read_text())
    assert {rank: entry["stage"] for rank, entry in timeline["ranks"].items()} == {"0": "0,2", "1": "1,3"}
    for rank, entry in timeline["ranks"].items():  # each rank's 2 chunks: a forward and a backward per micro-batch
        kinds = sorted(span[2] for span in entry["spans"])
        assert kinds == ["B"] * 8 + ["F"] * 8, kinds
        chunks = [int(stage) for stage in entry["stage"].split(",")]  # every span names its chunk
        assert sorted((span[4], span[2], span[3]) for span in entry["spans"]) == sorted(
            (stage, kind, mb) for stage in chunks for kind in "BF" for mb in range(4)
        ), entry["spans"]

    checkpoint = next(p for p in (first / "ckpt").iterdir() if "step=3" in p.name)
    saved = torch.load(checkpoint, weights_only=False)
    MLPModule().double().load_state_dict(saved["state_dict"])  # strict: every chunk's parameters, original keys
    assert len(saved["optimizer_states"][0]["state"]) == len(list(MLPModule().parameters()))  # Adam state of every parameter

    # the continuation from the checkpoint: under the chunked plan, and in one process
    # (one stage: single-device training) from the same file (Lightning restarts a plain
    # DataLoader on resume, so the continuation is not the uninterrupted run's)
    runs = {}
    for name, plan, devices in (("chunked", INTERLEAVED, 2), ("single", SINGLE, 1)):
        out = tmp_path / name
        resumed = _trainer(out, 6, plan=plan, devices=devices, callbacks=[LossRecorder(str(out / "losses.json"))], enable_checkpointing=False)
        continued = MLPModule().double()
        resumed.fit(continued, mlp_loader(3), ckpt_path=str(checkpoint))
        tail = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
        runs[name] = ([tail[s] for s in sorted(tail)], continued.state_dict())
    (chunked, chunked_state), (plain, plain_state) = runs["chunked"], runs["single"]
    assert len(chunked) == 3 and chunked[0] == pytest.approx(curve[4], abs=1e-10)  # the weights were restored
    assert chunked == pytest.approx(plain, abs=1e-10)
    assert max(float((chunked_state[k] - plain_state[k]).abs().max()) for k in plain_state) < 1e-10


@pytest.mark.timeout(300)
def test_a_zbv_plan_trains_and_validates_like_one_device(tmp_path: Path) -> None:
    """ZB-V on 2 ranks: rank 0 holds the first and the last stage (layer 0's input and the
    loss), rank 1 the two middle ones with the hand-off between them in process."""
    plan = {**INTERLEAVED, "schedule": "zbv", "stages": [{**stage, "devices": [device]} for stage, device in zip(INTERLEAVED["stages"], (0, 1, 1, 0))]}
    trainer = _trainer(tmp_path, 3, plan=plan, limit_val_batches=1, val_check_interval=3)
    model = MLPModule().double()
    trainer.fit(model, mlp_loader(3), mlp_loader(1))
    losses, _ = assert_trained_like_one_device(model, trainer)
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(losses[-1], abs=1e-10)
