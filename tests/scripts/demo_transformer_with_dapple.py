"""A module without a layer sequence on two processes, with a plan given by its shape only:
Lightning's demo ``LightningTransformer`` (a wrapper around ``nn.Transformer``), or, with
argv[2] == "untraceable", a module whose forward cannot be traced. Lightning's subprocess
launcher re-runs this file for rank 1. Rank 0 writes what it trained to the path in argv[1]."""
import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.transformer import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_dapple  # noqa: E402,F401
from traced_toys import Untraceable, vector_loader  # noqa: E402

SHAPE = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}


class OfflineTransformer(LightningTransformer):
    """The demo model as it is; only its data preparation (a WikiText-2 download) is skipped."""

    def prepare_data(self) -> None:
        pass


if __name__ == "__main__":
    torch.set_num_threads(1)
    from lightning_dapple.strategy import DappleStrategy

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if sys.argv[2:] == ["untraceable"]:
        model, loader = Untraceable(), vector_loader(dtype=torch.float32)
    else:
        model = OfflineTransformer(vocab_size=40)
        data = TensorDataset(torch.randint(0, 40, (16, 8), generator=generator), torch.randint(0, 40, (16, 8), generator=generator))
        loader = DataLoader(data, batch_size=8)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = Trainer(
        strategy=DappleStrategy(plan=SHAPE, timeout_s=90),
        accelerator="cpu", devices=2, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(Path(sys.argv[1]).parent),
    )
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        state = model.state_dict()
        changed = sorted(key for key in before if not torch.equal(before[key], state[key]))
        plan = trainer.strategy.plan
        Path(sys.argv[1]).write_text(json.dumps({"changed": changed, "keys": sorted(before), "stages": [list(stage.layers) for stage in plan.stages]}))
