"""Train a small model with Trainer(strategy="dapple") on 4 CPU processes, in plain Python.

The README's quick start runs the Hydra app instead (``bash scripts/quickstart.sh``, which
trains ``recipe=bert_pipeline_tiny``); this script shows the same strategy in your own
Lightning code: generated data, an
automatic plan (plan="auto"), the plan JSON in the log dir.

    python examples/quickstart.py                                   # 4 CPU processes
    python examples/quickstart.py --devices 2 --precision bf16-mixed
    python examples/quickstart.py --accelerator gpu --devices 2 --precision bf16-mixed
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dapple  # noqa: F401  registers "dapple"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.net(x))


class Regressor(LightningModule):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def data(samples: int = 2048, batch: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * x[:, 4:5]
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False, drop_last=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plan", default="auto", help="'auto' or a plan JSON path")
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu (one GPU per process)")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed, 16-mixed (GPU), 32-true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    trainer = Trainer(
        strategy=DappleStrategy(plan=args.plan),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        default_root_dir="outputs/quickstart",
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), data())
    log_dir = trainer.log_dir  # a collective: every rank asks
    if trainer.global_rank == 0:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}; plan in {log_dir}/dapple_plan.json")
