"""Under ``start_method="spawn"`` every rank gets one shared storage per module tensor
(torch.multiprocessing's pickling); Lightning copies parameters and buffers, not a metric's
states. ``strategy/unshare.py`` gives each rank its own: a ``SumMetric`` counts each update
once, as on one device, and each rank's state holds its own updates only."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.unshare import unshare_module_tensors, unshare_run_tensors

STEPS = 4


class CountingModule(LightningModule):
    """Counts its training steps in a ``SumMetric`` and a list state, writes each rank's
    local and synced counts when training ends."""

    def __init__(self, report_dir: str = "") -> None:
        super().__init__()
        self.report_dir = report_dir
        self.steps = torchmetrics.SumMetric()
        self.losses = torchmetrics.CatMetric()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.steps.update(torch.ones(()))
        self.losses.update(loss.detach())
        return loss

    def on_train_end(self) -> None:
        state = {"local": float(self.steps.sum_value), "shared": self.steps.sum_value.is_shared(), "synced": float(self.steps.compute())}
        (Path(self.report_dir) / f"count_rank{self.global_rank}.json").write_text(json.dumps(state))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CountingCallback(Callback):
    """Counts the batches it sees in a tensor attribute and a metric it holds, made before
    the launch (so a spawn shares them), and writes each rank's counts at the end."""

    def __init__(self, report_dir: str) -> None:
        self.report_dir = report_dir
        self.batches = torch.zeros(())
        self.metric = torchmetrics.SumMetric()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        self.metric.update(torch.ones(()))

    def on_train_end(self, trainer, pl_module) -> None:
        counts = {"batches": float(self.batches), "metric": float(self.metric.sum_value)}
        (Path(self.report_dir) / f"callback_rank{trainer.global_rank}.json").write_text(json.dumps(counts))


def test_shared_tensors_of_a_module_become_private_copies_with_the_same_values() -> None:
    module = CountingModule()
    module.steps.update(torch.tensor(3.0))
    module.losses.update(torch.tensor([0.5, 0.25]))
    weight = module.layers[0].weight
    for tensor in (weight, module.layers[0].bias, module.steps.sum_value, *module.steps._defaults.values(), *module.losses.value):
        tensor.share_memory_()
    before = {"sum": module.steps.sum_value.clone(), "weight": weight.detach().clone(), "losses": [t.clone() for t in module.losses.value]}
    copied = unshare_module_tensors(module)
    assert copied >= 5
    assert module.layers[0].weight is weight and not weight.is_shared()  # the Parameter object the user holds
    assert not module.steps.sum_value.is_shared() and torch.equal(module.steps.sum_value, before["sum"])
    assert not any(t.is_shared() for t in module.steps._defaults.values())
    assert not any(t.is_shared() for t in module.losses.value)
    assert all(torch.equal(a, b) for a, b in zip(module.losses.value, before["losses"]))
    assert torch.equal(weight.detach(), before["weight"])
    assert unshare_module_tensors(module) == 0  # nothing shared is left
    # a rank training on a GPU keeps its weights shared until it moves its own stage there
    weight.share_memory_()
    module.steps.sum_value.share_memory_()
    assert unshare_module_tensors(module, weights=False) == 1
    assert weight.is_shared() and not module.steps.sum_value.is_shared()
    # on the CPU the weight too; a callback without a __dict__ holds no attribute to copy, one
    # with a shared counter does
    slotted = type("Slotted", (Callback,), {"__slots__": ()})()
    counter = CountingCallback("")
    counter.batches.share_memory_()
    assert unshare_run_tensors(module, [slotted, counter], weights=True) == 2
    assert not weight.is_shared() and not counter.batches.is_shared()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_spawned_fit_counts_each_update_of_a_metric_once(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(8 * STEPS, 4)
    loader = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)
    plan = {"global_batch_size": 8, "micro_batches": 1, "stages": [{"layers": [0, 3], "devices": [0, 1]}]}
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=60), accelerator="cpu", devices=2, max_steps=STEPS,
        callbacks=[CountingCallback(str(tmp_path))],
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(CountingModule(str(tmp_path)), loader)
    counts = [json.loads((tmp_path / f"count_rank{rank}.json").read_text()) for rank in range(2)]
    # each replica runs the step on its half of every batch: STEPS updates per rank, 2 * STEPS in all
    assert [count["local"] for count in counts] == [STEPS, STEPS], counts
    assert [count["synced"] for count in counts] == [2 * STEPS, 2 * STEPS], counts
    assert not any(count["shared"] for count in counts)
    # a callback's tensor and metric, made before the launch, count each rank's own batches
    seen = [json.loads((tmp_path / f"callback_rank{rank}.json").read_text()) for rank in range(2)]
    assert seen == [{"batches": STEPS, "metric": STEPS}] * 2, seen
