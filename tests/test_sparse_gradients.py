"""``nn.Embedding(sparse=True)`` on replicated stages: its sparse gradient is summed over the
replicas with the stage's dense ones, and handed back sparse, as one device would hold it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_toys import states_under_plan_and_plain

VOCAB = 12


class BagOfWords(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.Sequential(nn.Embedding(VOCAB, 6, sparse=True), nn.Flatten(), nn.Linear(18, 4))

    def forward(self, tokens):
        return self.layers(tokens)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


@pytest.mark.timeout(300)
def test_a_sparse_embedding_on_two_replicas_trains_like_plain_lightning(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(14)
    data = [(torch.randint(0, VOCAB, (4, 3), generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)]

    plan = {"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1]}]}
    ours, plain = states_under_plan_and_plain(tmp_path, BagOfWords, data, plan)
    for name, value in plain.items():
        assert torch.allclose(ours[name], value, rtol=0, atol=1e-12), name
