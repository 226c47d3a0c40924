"""Batches as DataLoaders give them are cut into micro-batches whole: tensors by their rows,
and the per-sample items beside them (the ids or texts the default collate keeps as a tuple
of strings), inside NamedTuples, dicts and dataclasses alike."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_dapple  # noqa: F401
from lightning_dapple.execute.slicing import batch_size_of, take_rows
from lightning_dapple.strategy import DappleStrategy


class Pair(NamedTuple):
    x: torch.Tensor
    ids: list[str]


@dataclasses.dataclass
class Record:
    x: torch.Tensor
    ids: tuple[str, ...]
    temperature: float = 1.0


def test_per_sample_items_are_cut_with_the_rows_and_everything_else_is_kept() -> None:
    x = torch.arange(8.0).view(4, 2)
    ids = ("a", "b", "c", "d")
    got = take_rows((x, x[:, 0], ids), 1, 3)
    assert torch.equal(got[0], x[1:3]) and got[2] == ("b", "c")
    pair = take_rows(Pair(x, list(ids)), 0, 2)
    assert isinstance(pair, Pair) and pair.ids == ["a", "b"] and torch.equal(pair.x, x[:2])
    record = take_rows(Record(x, ids, 0.5), 2, 4)
    assert isinstance(record, Record) and record.ids == ("c", "d") and record.temperature == 0.5 and torch.equal(record.x, x[2:])
    nested = take_rows({"x": x, "meta": {"lengths": [3, 1, 2, 2]}, "table": torch.ones(1, 2), "name": "train"}, 3, 4)
    assert nested["meta"]["lengths"] == [2] and nested["name"] == "train" and nested["table"].shape == (1, 2)
    assert take_rows((x, ["a", "b"]), 0, 2)[1] == ["a", "b"]  # not the batch's length: a whole value
    assert batch_size_of(Record(x, ids)) == 4


class Tagged(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        return torch.randn(5, generator=g, dtype=torch.float64), int(index % 3), f"sample-{index}"


class WeightedById(LightningModule):
    """A per-sample weight looked up by id, and a sum divided by the ids' count: both need
    the step to see its own rows' ids. Batches arrive as the collate makes them."""

    WEIGHTS = {f"sample-{i}": 1.0 + 0.25 * i for i in range(8)}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y, ids = (batch.x, batch.y, batch.ids) if dataclasses.is_dataclass(batch) else batch
        weights = torch.tensor([self.WEIGHTS[i] for i in ids], dtype=x.dtype)
        return (F.cross_entropy(self(x), y, reduction="none") * weights).sum() / len(ids)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    y: torch.Tensor
    ids: list[str]


def _as_dataclass(samples) -> Example:
    xs, ys, ids = zip(*samples)
    return Example(torch.stack(xs), torch.tensor(ys), list(ids))


@pytest.mark.parametrize("collate", [None, _as_dataclass], ids=["default_collate", "dataclass"])
def test_a_step_using_its_ids_trains_like_plain_lightning(tmp_path: Path, collate) -> None:
    def fit(strategy) -> dict[str, torch.Tensor]:
        model = WeightedById().double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        ).fit(model, DataLoader(Tagged(), batch_size=4, collate_fn=collate))
        return model.state_dict()

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}]}
    ours, plain = fit(DappleStrategy(plan=plan, timeout_s=30)), fit("auto")
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12


def test_a_shuffled_loader_under_a_seed_yields_plain_lightnings_order(tmp_path: Path) -> None:
    """Set-up takes a sample batch and runs the step and the layers; none of it may move the
    seeded generators, or the first epoch's shuffle (and every dropout mask) differs."""
    from lightning.pytorch import seed_everything
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g))

    def fit(strategy) -> dict[str, torch.Tensor]:
        model = WeightedById().double()
        model.training_step = lambda batch, batch_idx: F.cross_entropy(model(batch[0]), batch[1])
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        seed_everything(42)
        trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
        return model.state_dict()

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}]}
    ours, plain = fit(DappleStrategy(plan=plan, timeout_s=30)), fit("auto")
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12
