"""Train with Lightning's own command line (LightningCLI) and the dapple strategy, set up
from a YAML file or from flags.

The model and data are the quick start's (``examples/quickstart.py``); the strategy is named
by class path, and each of its arguments is a flag or a key under
``trainer.strategy.init_args``:

    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --trainer.max_steps=20
    python examples/lightning_cli.py fit --trainer.strategy=lightning_dapple.DappleStrategy \\
        --trainer.strategy.plan=auto --trainer.strategy.micro_batches=2 \\
        --trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=10
    python examples/lightning_cli.py fit --config examples/lightning_cli.yaml --print_config

LightningCLI needs ``jsonargparse[signatures]`` (``pip install -e '.[test]'`` installs it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quickstart import Regressor, data  # noqa: E402


class RegressionData(LightningDataModule):
    """The quick start's generated regression data."""

    def __init__(self, samples: int = 2048, batch_size: int = 64) -> None:
        """
        Args:
            samples: how many generated samples in the training set.
            batch_size: the global batch (the plan slices it into micro-batches).
        """
        super().__init__()
        self.samples = samples
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return data(self.samples, self.batch_size)


class FinalLossCLI(LightningCLI):
    def after_fit(self) -> None:
        if self.trainer.global_rank == 0:
            print(f"final train_loss {float(self.trainer.callback_metrics['train_loss']):.4f}")


def main() -> None:
    torch.set_num_threads(1)
    FinalLossCLI(Regressor, RegressionData)


if __name__ == "__main__":
    main()
