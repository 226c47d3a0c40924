"""LightningModules and data for Trainer-level tests of the dapple strategy."""
from __future__ import annotations

import torch
import torchmetrics
import torch.nn.functional as F
import json

from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader, TensorDataset

import toy_models


class MLPModule(LightningModule):
    def __init__(self, lr: float = 1e-2, fail_at_step: int | None = None, fail_rank: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.layers = toy_models.mlp_layers()
        self.lr = lr
        self.fail_at_step = fail_at_step
        self.fail_rank = fail_rank
        self.val_mse = torchmetrics.MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        if self.fail_at_step is not None and batch_idx == self.fail_at_step and (self.fail_rank is None or self.global_rank == self.fail_rank):
            raise RuntimeError(f"deliberate failure at step {batch_idx}")
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("val_loss", loss)
        self.val_mse(out, y)
        self.log("val_mse", self.val_mse)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self(x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def mlp_loader(steps: int = 3, rows: int = 12, dtype: torch.dtype = torch.float64) -> DataLoader:
    xs, ys = zip(*(toy_models.mlp_batch(step, rows) for step in range(steps)))
    data = TensorDataset(torch.cat(xs).to(dtype), torch.cat(ys).to(dtype))
    return DataLoader(data, batch_size=rows, shuffle=False)


def single_device_run(steps: int = 3, clip: float = 0.5, return_model: bool = False, epochs: int = 1):
    """Plain training on one device: the reference the strategy must match."""
    model = MLPModule().double()
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    losses = []
    for x, y in [batch for _ in range(epochs) for batch in mlp_loader(steps)]:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss))
    if return_model:
        return model, losses
    return {k: v.clone() for k, v in model.state_dict().items()}, losses


class LossRecorder(Callback):
    """Writes rank 0's logged train_loss per global step to a JSON file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            self.losses[trainer.global_step] = float(trainer.callback_metrics["train_loss"])
            with open(self.path, "w") as stream:
                json.dump(self.losses, stream)


def _thread_names() -> list[str]:
    import os

    return sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task"))


class ExitCleanupProbe(Callback):
    """At the Trainer's last hook, runs the strategy's exit handler (shutdown.destroy_groups)
    and writes, per rank, whether one was registered and the OS threads still alive after it:
    gloo's worker threads ("pt_gloo_runloop") outliving it can abort the process at exit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def teardown(self, trainer, pl_module, stage) -> None:
        from lightning_dapple.execute import shutdown

        registered = [ref() is trainer.strategy for ref in shutdown._owners]
        before = _thread_names()
        shutdown.destroy_groups()
        with open(f"{self.directory}/exit_rank{trainer.global_rank}.json", "w") as stream:
            json.dump({"registered": registered, "before": before, "after": _thread_names()}, stream)
