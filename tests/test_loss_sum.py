"""A loss that is a sum over the rows is refused at the first step under loss_reduction="mean"
(``strategy/loss_sum.py``): weighting additive micro-batch losses by their rows would train
with a fraction of one device's gradients, silently."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.loss_check import LossWatch

ROWS = 4


def _watched_loss(loss_of, rows: int = ROWS) -> None:
    """Run ``loss_of(out, y, w)`` under the watch as the last stage's step would."""
    torch.manual_seed(0)
    x, y = torch.randn(rows, 3), torch.randn(rows, 2)
    w = torch.randn(2, 3, requires_grad=True)
    watch = LossWatch()
    forward = watch.marking(lambda inputs: F.linear(inputs, w))
    with watch.watching(rows, (x, y)):
        loss = loss_of(forward(x), y, w)
    watch.check(loss)


SUMS = {
    "mse sum": lambda out, y, w: F.mse_loss(out, y, reduction="sum"),
    "module sum": lambda out, y, w: nn.L1Loss(reduction="sum")(out, y),
    ".sum() of per-row losses": lambda out, y, w: F.mse_loss(out, y, reduction="none").sum(),
    "sum over a constant": lambda out, y, w: F.mse_loss(out, y, reduction="sum") / 32,
    "sum plus a mean": lambda out, y, w: (out - y).pow(2).sum() + F.mse_loss(out, y),
    "sum cast": lambda out, y, w: F.mse_loss(out, y, reduction="sum").double() * 2,
}
MEANS = {
    "mse mean": lambda out, y, w: F.mse_loss(out, y),
    "sum over len": lambda out, y, w: F.mse_loss(out, y, reduction="sum") / len(y),
    "sum over elements": lambda out, y, w: (out - y).pow(2).sum() / y.numel(),
    "sum times the inverse": lambda out, y, w: (out - y).pow(2).sum() * (1.0 / y.shape[0]),
    "mean plus a weight penalty": lambda out, y, w: F.mse_loss(out, y) + 1e-3 * w.pow(2).sum(),
    "sum over a count the data made": lambda out, y, w: (out - y).pow(2).sum() / torch.ones_like(y).sum(),
    "per-row sums, then a mean": lambda out, y, w: (out - y).pow(2).sum(-1).mean(),
}


@pytest.mark.parametrize("name", list(SUMS))
def test_a_sum_over_rows_is_refused_naming_loss_reduction_sum(name: str) -> None:
    with pytest.raises(DappleConfigError, match=r"loss_reduction: is 'mean'.*is a sum over the rows.*Fix: pass DappleStrategy\(loss_reduction='sum'\)"):
        _watched_loss(SUMS[name])


@pytest.mark.parametrize("name", list(MEANS))
def test_a_mean_over_rows_or_a_parameter_penalty_passes(name: str) -> None:
    _watched_loss(MEANS[name])


class SummedRegression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layers = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y, reduction="sum")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path: Path, model: LightningModule, strategy) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(ROWS, 5, generator=g, dtype=torch.float64), torch.randn(ROWS, 2, generator=g, dtype=torch.float64)) for _ in range(3)]
    Trainer(
        strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    ).fit(model, DataLoader(data, batch_size=None))


def _plan() -> dict:
    return {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}]}


def test_a_summed_loss_is_refused_before_any_parameter_changes_and_trains_exactly_with_sum(tmp_path: Path) -> None:
    """M = 2: under 'mean' the summed loss would train at half of one device's gradients; it
    is refused before the first optimizer step. Under loss_reduction='sum' it trains as
    plain Lightning does (float64)."""
    model = SummedRegression().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DappleConfigError, match=r"mse_loss\(reduction='sum'\).*loss_reduction='sum'"):
        _fit(tmp_path / "mean", model, DappleStrategy(plan=_plan(), timeout_s=20))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    summed, plain = SummedRegression().double(), SummedRegression().double()
    _fit(tmp_path / "sum", summed, DappleStrategy(plan=_plan(), timeout_s=20, loss_reduction="sum"))
    _fit(tmp_path / "plain", plain, "auto")
    for key, value in plain.state_dict().items():
        assert torch.allclose(summed.state_dict()[key], value, rtol=1e-10, atol=1e-12), key
