"""LightningModules and data for Trainer-level tests of the dapple strategy."""
from __future__ import annotations

import torch
import torchmetrics
import torch.nn.functional as F
import json

import pytest

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


def assert_trained_like_one_device(model: LightningModule, trainer, steps: int = 3, clip: float = 0.5, epochs: int = 1) -> tuple[list[float], float]:
    """The fitted ``model`` (rank 0's, the whole model gathered back) equals plain training on
    one device in float64: every parameter within 1e-10, and the validation loss Lightning
    logged equals the model's on the validation batch. Returns the reference's loss per step
    and that validation loss."""
    reference, losses = single_device_run(steps, clip=clip, epochs=epochs)
    state = model.state_dict()
    assert set(state) == set(reference)  # rank 0 got the whole model back
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    x, y = next(iter(mlp_loader(1)))
    with torch.no_grad():
        expected_val = float(F.mse_loss(model(x), y))
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(expected_val, abs=1e-10)
    return losses, expected_val


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
    """Names of this process's OS threads; a thread that ends while they are read is left out."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as stream:
                names.append(stream.read().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return sorted(names)


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


class FloatMLPModule(MLPModule):
    """The MLP in float32 (mixed precision keeps float32 master weights); ``poison``:
    (global step, rank) at which this rank's gradients are overwritten with inf after the
    backward, as an fp16 overflow on that stage would leave them."""

    def __init__(self, poison: tuple[int, int] | None = None, sgd: bool = False) -> None:
        super().__init__(lr=1e-2)
        self.poison = poison
        self.sgd = sgd

    def on_after_backward(self) -> None:
        if self.poison is not None and (self.global_step, self.global_rank) == tuple(self.poison):
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("inf"))

    def configure_optimizers(self):
        if self.sgd:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class ScaleRecorder(Callback):
    """Per rank, after every batch: the GradScaler's scale and how many optimizer steps
    the first local parameter has taken (Adam's ``step`` counter); written to
    ``<directory>/scale_rank<r>.json`` at the end."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizer = trainer.optimizers[0]
        steps = [float(state["step"]) for state in optimizer.state.values() if "step" in state]
        self.rows.append({"scale": float(scaler.get_scale()) if scaler is not None else 1.0, "adam_steps": max(steps, default=0.0)})

    def on_train_end(self, trainer, pl_module) -> None:
        with open(f"{self.directory}/scale_rank{trainer.global_rank}.json", "w") as stream:
            json.dump(self.rows, stream)


class AliasedLayers(MLPModule):
    """Keeps a second reference to its layers (``self.model.layers`` is ``self.layers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = self.layers


class TwoArgumentForward(MLPModule):
    """Lightning's transformer demo style: ``training_step`` calls ``self(inputs, target)``."""

    def forward(self, x, target=None):
        return super().forward(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x, y), y)


class MoveRecorder(torch.nn.Module):
    """Wraps a layer and records, per process, every ``Module.to(device)`` applied to it
    (directly or through a parent) as (layer index, device type asked for), in order
    (``MOVES``); dtype-only conversions are not moves."""

    MOVES: list[tuple[int, str]] = []

    def __init__(self, index: int, inner: torch.nn.Module) -> None:
        super().__init__()
        self.index = index
        self.inner = inner

    def forward(self, x):
        return self.inner(x)

    def _apply(self, fn, recurse=True):
        # Module.to's conversion closure holds the requested device (None for a dtype change)
        cells = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))
        result = super()._apply(fn, recurse)
        if cells.get("device") is not None:
            MoveRecorder.MOVES.append((self.index, torch.device(cells["device"]).type))
        return result


class TrackedMLPModule(MLPModule):
    """The MLP with every layer's device moves recorded; ``record_at_fit_start`` writes
    them per rank to ``<directory>/moves_rank<r>.json`` once setup is done."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(MoveRecorder(i, layer) for i, layer in enumerate(self.layers)))
        self.directory = directory

    def on_fit_start(self) -> None:
        placed = {i: next(layer.parameters()).device.type for i, layer in enumerate(self.layers) if any(True for _ in layer.parameters())}
        with open(f"{self.directory}/moves_rank{self.global_rank}.json", "w") as stream:
            json.dump({"moves": MoveRecorder.MOVES, "placed": placed, "freed": sorted(self.trainer.strategy._freed)}, stream)


def quiet_trainer(root: str, **kwargs) -> "Trainer":
    """A Trainer without logger, checkpoints, progress bar or summary, writing under ``root``."""
    from lightning.pytorch import Trainer

    flags = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))
    return Trainer(**{**flags, **kwargs})


def states_under_plan_and_plain(tmp_path, make_model, data, plan: dict, **trainer_kwargs) -> tuple[dict, dict]:
    """The state dicts after fitting ``make_model()`` (made float64) on ``data`` (a list of
    batches) under ``plan`` on its processes (spawned) and under plain Lightning."""
    from lightning.pytorch import Trainer

    from lightning_dapple.strategy import DappleStrategy

    options = {"max_steps": 3, "enable_model_summary": False, **trainer_kwargs}

    def fit(strategy, devices: int) -> dict:
        model = make_model().double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, default_root_dir=str(tmp_path), **options,
        ).fit(model, DataLoader(data, batch_size=None))
        return model.state_dict()

    devices = len({rank for stage in plan["stages"] for rank in stage["devices"]})
    return fit(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), devices), fit("auto", 1)
