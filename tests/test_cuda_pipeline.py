"""A pipeline on one GPU: three ranks share it through the staged wire (execute/transfer/wires.py).

Three processes on ``cuda:0`` joined by gloo: CUDA tensors cross every stage boundary
through pinned host buffers, so one GPU runs the strategy's multi-rank CUDA paths that a
one-stage plan never reaches: split-concat sends (DAPPLE 5.2.2), the gradient AllReduce of
a replicated stage, out-of-order backprop's deferred weight gradients under autocast
(ooo-backprop sec. 3), recomputation through the strategy (gpipe.txt 2.3) with BatchNorm,
the fp16 loss scale agreed over the plan, the result hand-off, and checkpoint
consolidation and resume through the Trainer.

* Mixed precision (``bf16-mixed``, ``16-mixed``): a 2:1 plan with ooo and recomputation,
  three SGD steps. The update equals that of plain Lightning on the same GPU at the same
  precision within a relative error honest for the precision: the pipeline runs the same
  operations on row slices (3 and 6 rows instead of 12), which changes the rounding of
  each half-precision product and of the gradient sums; a few units of the half type's
  epsilon (2^-8 for bf16, 2^-11 for fp16) is what that costs, a wrong or missing slice
  costs the order of the update itself.
* float64 with BatchNorm: a three-stage plan (BatchNorm on two stages) with recomputation
  and ooo trains two epochs, checkpointing each; it equals single-process training over
  the same micro-batches to 1e-10 (running statistics and ``num_batches_tracked`` too:
  the stage moves to the GPU after the runner is built, so buffers found earlier would be
  stale), and a run resumed from the first epoch's checkpoint ends with the same
  parameters, buffers and optimizer state.

Skipped where torch sees no CUDA device. A mixed-precision case starts the ranks once,
the BatchNorm case twice (the run and its resumption). The helpers take the device, so the
same code runs on the CPU (``mixed_precision_update(root, precision, "cpu")``,
``norm_checkpoints(root, "cpu")``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import FloatMLPModule, mlp_loader, quiet_trainer
from test_recompute_buffers import NormModule, micro_batched_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RANKS = 3
MIXED_PLAN = {
    "global_batch_size": 12,
    "micro_batches": 2,
    "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2]}],
}
NORM_PLAN = {
    "global_batch_size": 12,
    "micro_batches": 2,
    "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 2], "devices": [1]}, {"layers": [2, 3], "devices": [2]}],
}
# relative error of the update: about 8 units of the half type's epsilon
UPDATE_TOLERANCE = {"bf16-mixed": 8 * 2.0**-8, "16-mixed": 8 * 2.0**-11}
HALF = {"bf16-mixed": "torch.bfloat16", "16-mixed": "torch.float16"}


def shared_device_strategy(device: str, plan: dict, **options: Any) -> DappleStrategy:
    """``RANKS`` processes on one ``device``, joined by gloo, CUDA tensors staged through
    pinned host buffers; out-of-order backprop and recomputation on."""
    return DappleStrategy(
        plan=plan,
        parallel_devices=[torch.device(device)] * RANKS,
        process_group_backend="gloo",
        wire="staged",
        start_method="spawn",
        timeout_s=60,
        ooo=True,
        recompute="always",
        **options,
    )


def _accelerator(device: str) -> str:
    return "gpu" if torch.device(device).type == "cuda" else "cpu"


def _precision_flags(precision: str, device: str) -> dict[str, Any]:
    """A fixed initial fp16 loss scale (2^10), so that neither run skips a step on an overflow."""
    if precision == "16-mixed":
        device_type = torch.device(device).type
        return {"plugins": [MixedPrecision("16-mixed", device_type, scaler=torch.amp.GradScaler(device_type, init_scale=2.0**10))]}
    return {"precision": precision}


class DtypeRecorder(FloatMLPModule):
    """The float32 MLP with SGD (an update proportional to the gradients); each rank writes
    the dtypes of the stage outputs its training_step saw (the last stage's: autocast's)."""

    def __init__(self, directory: str) -> None:
        super().__init__(sgd=True)
        self.directory = directory
        self.seen: set[str] = set()
        self.recording = False  # not the strategy's set-up check, which runs without autocast

    def on_train_start(self) -> None:
        self.recording = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        if self.recording:
            self.seen.add(str(out.dtype))
        return F.mse_loss(out, y)

    def on_train_end(self) -> None:
        with open(f"{self.directory}/dtypes_rank{self.global_rank}.json", "w") as stream:
            json.dump(sorted(self.seen), stream)


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([state[key].detach().double().cpu().reshape(-1) for key in sorted(state)])


def mixed_precision_update(root: Path, precision: str, device: str) -> tuple[float, list[list[str]]]:
    """The pipeline's update relative to plain Lightning's at the same precision
    (||pipeline - plain|| / ||plain||), and the output dtypes each rank saw."""
    root.mkdir(parents=True, exist_ok=True)
    start = _flat(DtypeRecorder(str(root)).state_dict())
    updates = []
    for name, strategy in (("plain", "auto"), ("dapple", shared_device_strategy(device, MIXED_PLAN))):
        directory = root / name
        directory.mkdir()
        model = DtypeRecorder(str(directory))
        trainer = quiet_trainer(
            strategy=strategy, accelerator=_accelerator(device), devices=1, max_steps=3, root=directory, **_precision_flags(precision, device)
        )
        trainer.fit(model, mlp_loader(3, dtype=torch.float32))
        updates.append(_flat(model.state_dict()) - start)
    plain, pipeline = updates
    seen = [json.loads((root / "dapple" / f"dtypes_rank{rank}.json").read_text()) for rank in range(RANKS)]
    return float((pipeline - plain).norm() / plain.norm()), seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_pipeline_on_one_gpu_matches_plain_lightning(tmp_path: Path, precision: str) -> None:
    relative, seen = mixed_precision_update(tmp_path, precision, "cuda:0")
    assert seen[2] == [HALF[precision]], seen  # the last stage computed under autocast
    assert relative < UPDATE_TOLERANCE[precision], relative


def _norm_fit(root: Path, device: str, resume: Path | None = None) -> Path:
    """Two epochs of two batches in float64, a checkpoint at the end of each; returns the
    checkpoint directory."""
    checkpoints = root / "checkpoints"
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    trainer: Trainer = quiet_trainer(
        strategy=shared_device_strategy(device, NORM_PLAN),
        accelerator=_accelerator(device),
        devices=1,
        max_epochs=2,
        precision="64-true",
        root=root,
        enable_checkpointing=True,
        callbacks=[saver],
    )
    trainer.fit(NormModule(), mlp_loader(2, dtype=torch.float64), ckpt_path=str(resume) if resume is not None else None)
    return checkpoints


def _gap(a: Any, b: Any) -> float:
    """Largest difference between two nested structures of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        return float((a.double().cpu() - torch.as_tensor(b).double().cpu()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert set(a) == set(b), (sorted(a), sorted(b))
        return max([_gap(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max([_gap(x, y) for x, y in zip(a, b)] or [0.0])
    assert a == b, (a, b)
    return 0.0


def norm_checkpoints(root: Path, device: str) -> tuple[dict, dict, dict[str, list]]:
    """The final checkpoints of the two-epoch run and of a run resumed from its first
    epoch's checkpoint, and the single-process reference (``micro_batched_reference``)."""
    full = _norm_fit(root / "full", device)
    first = next(path for path in full.iterdir() if path.name.startswith("epoch=0"))
    resumed = _norm_fit(root / "resumed", device, resume=first)
    last = [next(path for path in directory.iterdir() if path.name.startswith("epoch=1")) for directory in (full, resumed)]
    a, b = (torch.load(path, map_location="cpu", weights_only=False) for path in last)
    batches = [batch for _ in range(2) for batch in mlp_loader(2, dtype=torch.float64)]
    return a, b, micro_batched_reference(batches)


@pytest.mark.timeout(120)
def test_batch_norm_recomputation_and_resume_on_one_gpu(tmp_path: Path) -> None:
    full, resumed, reference = norm_checkpoints(tmp_path, "cuda:0")
    state = full["state_dict"]
    assert full["global_step"] == resumed["global_step"] == 4
    for key, value in reference.items():
        got = state[f"layers.{key}"].double().reshape(-1)
        gap = float((got - torch.tensor(value, dtype=torch.float64)).abs().max())
        assert gap < 1e-10, (key, gap)
    assert int(state["layers.1.norm.num_batches_tracked"]) == 2 * 4  # two micro-batches a step, counted once
    assert _gap(full["state_dict"], resumed["state_dict"]) < 1e-10
    assert _gap(full["optimizer_states"], resumed["optimizer_states"]) < 1e-10
