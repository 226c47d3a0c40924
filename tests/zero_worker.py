"""The fits of ``test_zero.py``, run in turn inside one process group per device count (a
process start costs seconds here): each a ``Trainer.fit`` under ``DappleStrategy(zero=...)``
of the conformance table's classifier, with gradient clipping, whose end checkpoint and
per-rank byte counts come back to the test.

A fit is a dict: ``name``; ``plan``; ``zero``; ``options`` (more ``DappleStrategy``
keywords); ``epochs`` (default 1: 3 steps); ``precision`` ("64-true", or "16-mixed": float32
weights under Lightning's CPU GradScaler plugin); ``resume``: the name of an earlier fit
whose end checkpoint it resumes from; ``bucket_bytes``: the gradient buckets' size;
``accumulate``: ``Trainer(accumulate_grad_batches)``."""
from __future__ import annotations

import io
import os
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from conformance.behaviours import BATCH, Classifier, dataset

CLIP = 0.5
ROWS = 3 * BATCH


class HeldBytes(Callback):
    """This rank's gradient bytes before each optimizer step (after the backward and the
    replicas' reduction: what the step holds) and its optimizer-state bytes after training;
    per step, how its stage's gradient buckets went: (buckets, launched during the backward,
    reduced to owners)."""

    def __init__(self) -> None:
        self.grad_bytes: list[int] = []
        self.buckets: list[tuple[int, int, bool]] = []
        self.state_bytes = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grad_bytes.append(sum(p.grad.numel() * p.grad.element_size() for p in pl_module.parameters() if p.grad is not None))
        sync = trainer.strategy.runner.sync
        if sync is not None:
            self.buckets.append((sync.num_buckets, sync.launched_early, sync.owners is not None))

    def on_train_end(self, trainer, pl_module) -> None:
        self.state_bytes = sum(
            v.numel() * v.element_size() for opt in trainer.optimizers for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
        )


class SmallBuckets(Callback):
    """Rebuild the stage's gradient buckets at ``size`` bytes once training starts (a layer
    a bucket here), as the runner rebuilds them when layers are frozen or unfrozen."""

    def __init__(self, size: int) -> None:
        self.size = size

    def on_train_start(self, trainer, pl_module) -> None:
        runner = trainer.strategy.runner
        if runner.sync is not None:
            runner.sync.close()
            runner._bucket_bytes = self.size
            runner.sync = runner._build_sync(self.size)


def data(precision: str) -> DataLoader:
    """The conformance data's first ``ROWS`` rows in global batches of ``BATCH`` (an epoch is
    3 steps); float32 features under mixed precision."""
    x, y, ids = (tensor[:ROWS] for tensor in dataset().tensors)
    return DataLoader(TensorDataset(x if precision == "64-true" else x.float(), y, ids), batch_size=BATCH)


def model_for(precision: str) -> Classifier:
    return Classifier().double() if precision == "64-true" else Classifier()


def precision_flags(precision: str) -> dict[str, Any]:
    """``Trainer`` keywords for ``precision`` (16-mixed on the CPU as test_precision.py runs it)."""
    return {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}


def _one(fit: dict[str, Any], root: str, world: int) -> dict[str, Any]:
    from lightning_dapple.strategy import DappleStrategy

    precision = fit.get("precision", "64-true")
    here = os.path.join(root, fit["name"])
    os.makedirs(here, exist_ok=True)
    held = HeldBytes()
    trainer = Trainer(
        strategy=DappleStrategy(plan=fit["plan"], timeout_s=60, zero=fit["zero"], **fit.get("options", {})),
        accelerator="cpu", devices=world, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=here, gradient_clip_val=CLIP, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[held, *([SmallBuckets(fit["bucket_bytes"])] if "bucket_bytes" in fit else [])], max_epochs=fit.get("epochs", 1), accumulate_grad_batches=fit.get("accumulate", 1), **precision_flags(precision),
    )
    resume = os.path.join(root, fit["resume"], "end.ckpt") if "resume" in fit else None
    trainer.fit(model_for(precision), data(precision), ckpt_path=resume)
    end = os.path.join(here, "end.ckpt")
    trainer.save_checkpoint(end)
    out: dict[str, Any] = {"grad_bytes": held.grad_bytes, "buckets": held.buckets, "state_bytes": held.state_bytes}
    if trainer.global_rank == 0:
        if os.path.isdir(end):  # checkpoint="sharded": read back as one file
            from lightning_dapple.strategy.sharded_checkpoint import consolidate

            consolidate(end, os.path.join(here, "consolidated.ckpt"))
            end = os.path.join(here, "consolidated.ckpt")
        out["checkpoint"] = torch.load(end, weights_only=False)
    return out


def fits(rank: int, world: int, plan_fits: list[dict[str, Any]], root: str) -> bytes:
    """Every fit of ``plan_fits`` in turn on this rank (a ``run_ranks`` worker); by name,
    each rank's byte counts and, on rank 0, the end checkpoint, as bytes."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    import lightning_dapple  # noqa: F401

    out = {fit["name"]: _one(fit, root, world) for fit in plan_fits}
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def plain(root: str, precision: str = "64-true", epochs: int = 1, clip: float | None = CLIP, accumulate: int = 1) -> dict[str, Any]:
    """The same fit under plain Lightning on this one process: its end checkpoint."""
    trainer = Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, gradient_clip_val=clip, num_sanity_val_steps=0, limit_val_batches=0, max_epochs=epochs,
        accumulate_grad_batches=accumulate, **precision_flags(precision),
    )
    trainer.fit(model_for(precision), data(precision))
    end = os.path.join(root, "end.ckpt")
    trainer.save_checkpoint(end)
    return torch.load(end, weights_only=False)
