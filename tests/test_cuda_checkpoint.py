"""Checkpoints of training on GPUs: the file holds CPU tensors only, loads where no GPU
exists, and resumes (strategy/part_stream.py, strategy/checkpoint.py).

Skipped where torch sees no CUDA device (CI runs the same worker on CPU:
tests/test_checkpoint_gather.py); run them on a GPU machine with
``pytest tests/test_cuda_checkpoint.py``.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dapple  # noqa: F401
from dist_harness import run_ranks
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import MLPModule, mlp_loader, quiet_trainer
from test_checkpoint_gather import gather_worker, load_without_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ONE_STAGE = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0]}]}
TWO_STAGES = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


@pytest.mark.timeout(300)
def test_two_ranks_sharing_one_gpu_save_cpu_tensors_and_resume(tmp_path: Path) -> None:
    """A 2-stage pipeline on one GPU (gloo, CUDA tensors, the staged wire) whose Adam state
    lives on the GPU: the parts cross on the CPU, neither rank allocates GPU memory for
    the save, the file loads with ``map_location=None`` in a process without CUDA, and the
    resumed run ends where the uninterrupted one does."""
    results = run_ranks(gather_worker, 2, str(tmp_path), "cuda:0", "staged", ("straight-2",), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    zero = results[0]["straight-2"]
    for rank in (0, 1):
        facts = results[rank]["straight-2"]
        assert "cuda" in facts["optimizer_devices"], (rank, facts)
        assert facts["sent_plain_cpu"] and facts["claimed"]["sent_plain_cpu"], (rank, facts)
        assert facts["gpu_growth"] == 0, (rank, facts)
        assert facts["resumed_keys"] > 0 and facts["never_stopped_diff"] < 1e-10 and facts["resume_diff"] < 1e-8, (rank, facts)
    assert results[1]["straight-2"]["claimed"]["sent"] > 0
    assert zero["all_cpu"] and zero["claimed"]["arrived_plain_cpu"] and zero["claimed"]["same_values"], zero
    assert zero["peak"] <= zero["consolidated"] + zero["largest_part"], zero
    assert zero["plain_diff"] < 1e-8 and zero["adam_diff"] < 1e-8 and zero["adam_names"], zero
    assert load_without_cuda(tmp_path / "straight-2.ckpt") == "cpu"


def _fit(root: Path, plan: dict, max_steps: int, devices: int, ckpt_path: Path | None = None, accelerator: str = "gpu") -> dict[str, torch.Tensor]:
    """Fit the toy MLP in float64 on GPUs, keeping a checkpoint every 3 steps (one epoch)
    chosen by the logged train loss, so its callback state holds a score on the GPU."""
    model = MLPModule().double()
    keep = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", monitor="train_loss", every_n_train_steps=3, save_top_k=-1)
    strategy = DappleStrategy(plan=plan, timeout_s=60, start_method="spawn" if devices > 1 else "popen")
    trainer = quiet_trainer(
        root, strategy=strategy, accelerator=accelerator, devices=devices, max_steps=max_steps, precision="64-true",
        enable_checkpointing=True, callbacks=[keep],
    )
    trainer.fit(model, mlp_loader(3), ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _check_save_and_resume(tmp_path: Path, plan: dict, devices: int, accelerator: str = "gpu") -> None:
    never_stopped = _fit(tmp_path / "full", plan, 6, devices, accelerator=accelerator)
    saved = tmp_path / "full" / "ckpt" / "step=3.ckpt"
    assert load_without_cuda(saved) == "cpu"
    resumed = _fit(tmp_path / "resumed", plan, 6, devices, ckpt_path=saved, accelerator=accelerator)
    assert max(float((resumed[k] - never_stopped[k]).abs().max()) for k in never_stopped) < 1e-10


@pytest.mark.timeout(300)
def test_a_checkpoint_written_on_the_gpu_loads_without_one_and_resumes(tmp_path: Path) -> None:
    """Through Lightning on one GPU: the optimizer state and the callback's best score are
    CUDA tensors when the save starts."""
    _check_save_and_resume(tmp_path, ONE_STAGE, devices=1)


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_checkpoint_of_two_gpus_under_nccl_loads_without_one_and_resumes(tmp_path: Path) -> None:
    """Two stages on two GPUs under NCCL: the parts take the gloo lane the strategy opens."""
    _check_save_and_resume(tmp_path, TWO_STAGES, devices=2)
