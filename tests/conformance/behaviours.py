"""The user behaviours of the conformance table: one LightningModule (and its callbacks and
Trainer flags) per behaviour, written as Lightning users write them.

Every behaviour fits the same classifier family on the same data: 32 rows of 6 features and 3
classes, with a row id beside them so that the batches' order can be read back, in global
batches of 8. ``BEHAVIOURS`` maps a name to a ``Behaviour``; ``fit_and_observe`` runs one and
returns what a user can observe of the fit (``observe.py``)."""
from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROWS, FEATURES, CLASSES, BATCH = 32, 6, 3, 8


def dataset(seed: int = 21) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (ROWS,), generator=g)
    return TensorDataset(x, y, torch.arange(ROWS))


class Classifier(LightningModule):
    """Five layers (so that a chunked plan has a layer per chunk), a mean over samples as
    the loss, training/validation/test/predict steps that log as the docs show."""

    def __init__(self, seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, CLASSES))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).double().mean())

    def test_step(self, batch, batch_idx):
        x, y, _ = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class ReducedLogs(Classifier):
    """Every reduce_fx over per-row values (exact on any plan) and over a batch mean (the
    documented difference where a plan cuts the batch, with its warning)."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        right = (logits.argmax(-1) == y).double()
        self.log("right_sum", right.sum(), reduce_fx="sum", on_step=True, on_epoch=True)
        self.log("logit_max", logits.max(), reduce_fx="max", on_step=False, on_epoch=True)
        self.log("logit_min", logits.min(), reduce_fx="min", on_step=False, on_epoch=True)
        self.log_dict({"loss_mean": loss, "acc": right.mean()}, on_step=False, on_epoch=True)
        self.log("loss_sum", loss, reduce_fx="sum", on_step=False, on_epoch=True)  # a batch mean: differs when cut
        return loss


class StepScheduled(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class EpochScheduled(Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
        return [optimizer], [torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)]


class ZeroGradHook(Classifier):
    """Reads the previous step's gradients where Lightning is about to zero them."""

    def on_before_zero_grad(self, optimizer) -> None:
        present = sum(p.grad is not None for p in self.parameters())
        self.log("grads_before_zero", float(present > 0), on_step=True, on_epoch=False)


class ClampWeights(Callback):
    """A user callback touching parameters: weight clipping after every batch."""

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for parameter in pl_module.parameters():
            parameter.clamp_(-0.3, 0.3)


class BatchOrder(Callback):
    """The row ids of every training batch, in the order the loop saw them."""

    def __init__(self) -> None:
        self.ids: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ids.append(batch[2].tolist())


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """One row of the table: the module, its callbacks, Trainer flags, the loaders, what to
    run after fit, and what may differ from plain Lightning (with the warning that says so)."""

    make_model: Callable[[], LightningModule] = Classifier
    callbacks: Callable[[str], list[Callback]] = lambda root: []
    trainer: dict[str, Any] = dataclasses.field(default_factory=dict)
    shuffle: bool = False
    seeded: bool = False  # seed_everything(7) before the model and the data, as scripts do
    after_fit: tuple[str, ...] = ()  # "validate", "test", "predict"
    resume_at: int | None = None  # fit this many steps, save, and resume in a new Trainer
    differs_when_cut: tuple[str, ...] = ()  # logged names documented to differ where the batch is cut
    warns: str | None = None  # a warning text expected where the batch is cut


BEHAVIOURS: dict[str, Behaviour] = {
    "logging": Behaviour(trainer={"max_epochs": 2, "val_check_interval": 2}, after_fit=("validate", "test")),
    "reduce_fx": Behaviour(make_model=ReducedLogs, differs_when_cut=("loss_sum",), warns="self.log('loss_sum', ..., reduce_fx='sum')"),
    "seed_then_shuffle": Behaviour(shuffle=True, seeded=True, trainer={"max_epochs": 2}),
    "checkpoint_and_early_stopping": Behaviour(
        callbacks=lambda root: [
            ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), monitor="val_loss", save_top_k=2, save_last=True),
            EarlyStopping(monitor="val_loss", patience=1, min_delta=1e9),
        ],
        trainer={"max_epochs": 4},
    ),
    "lr_monitor_and_step_scheduler": Behaviour(make_model=StepScheduled, callbacks=lambda root: [LearningRateMonitor("step")], trainer={"max_epochs": 2}),
    "epoch_scheduler": Behaviour(make_model=EpochScheduled, callbacks=lambda root: [LearningRateMonitor("epoch")], trainer={"max_epochs": 3}),
    "callback_touching_parameters": Behaviour(callbacks=lambda root: [ClampWeights()], trainer={"max_epochs": 2}),
    "predict_after_fit": Behaviour(after_fit=("predict",)),
    "resume_mid_epoch": Behaviour(resume_at=2, trainer={"max_epochs": 2}),
    "accumulate_grad_batches": Behaviour(trainer={"max_epochs": 2, "accumulate_grad_batches": 2}),
    "zero_grad_hook": Behaviour(make_model=lambda: ZeroGradHook(), trainer={"max_epochs": 2}),
}


def fit_and_observe(behaviour: Behaviour, root: str, strategy: Any, devices: int) -> dict[str, Any]:
    """Fit ``behaviour`` under ``strategy`` on ``devices`` processes, writing under ``root``;
    what rank 0 observes (``observe.observe``), or {} on the other ranks."""
    from conformance.observe import observe

    Path(root).mkdir(parents=True, exist_ok=True)
    if behaviour.seeded:
        seed_everything(7, verbose=False)
    model = behaviour.make_model().double()
    data = dataset()
    order = BatchOrder()
    flags = {"max_epochs": 1, "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False, **behaviour.trainer}

    def trainer(**extra: Any) -> Trainer:
        return Trainer(
            strategy=strategy() if callable(strategy) else strategy, accelerator="cpu", devices=devices, precision="64-true",
            logger=CSVLogger(root, name="csv", version=0), default_root_dir=root,
            callbacks=[order, *behaviour.callbacks(root)], **{**flags, **extra},
        )

    train = DataLoader(data, batch_size=BATCH, shuffle=behaviour.shuffle)
    val = DataLoader(data, batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if behaviour.resume_at is not None:
            first = trainer(max_steps=behaviour.resume_at, enable_checkpointing=False)
            first.fit(model, train, val)
            first.save_checkpoint(os.path.join(root, "mid.ckpt"))
            fitted = trainer(enable_checkpointing=False)
            model = behaviour.make_model().double()
            fitted.fit(model, train, val, ckpt_path=os.path.join(root, "mid.ckpt"))
        else:
            fitted = trainer()
            fitted.fit(model, train, val)
        metrics = {"fit": _floats(fitted.callback_metrics), "fit_logged": _floats(fitted.logged_metrics)}
        predictions = None
        for what in behaviour.after_fit:
            if what == "predict":
                predictions = torch.cat(fitted.predict(model, DataLoader(data, batch_size=BATCH)))
            else:
                getattr(fitted, what)(model, val)
                metrics[what] = _floats(fitted.callback_metrics)
        fitted.save_checkpoint(os.path.join(root, "final.ckpt"))
    if fitted.global_rank != 0:
        return {}
    return observe(fitted, root, metrics, order.ids, predictions, [str(w.message) for w in caught])


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}
