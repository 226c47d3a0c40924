"""A GPT-style model with its output projection tied to its token embedding, for the tests.

Written the way people write GPT-2: token embedding plus learned positions, pre-LN causal
blocks, a final LayerNorm and a bias-free head whose weight is the token embedding's
(``head.weight = tok.weight``). As a layer list: layer 0 embeds, the blocks follow, the
last layer normalises and projects; layer 0 and the last layer share one parameter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toy_models
from lightning_dapple.strategy.resume import ResumableDataLoader

VOCAB, WIDTH, LENGTH = 11, 8, 5


class TokenAndPosition(nn.Module):
    def __init__(self, vocab: int, width: int, length: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(length, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class CausalBlock(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        attended, _ = self.attention(h, h, h, attn_mask=causal, need_weights=False)
        x = x + attended
        return x + self.mlp(self.ln2(x))


class NormAndHead(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def tied_gpt_layers(blocks: int = 3) -> nn.Sequential:
    """Embedding, ``blocks`` causal blocks, norm + head: 5 layers by default, the head's
    weight being the token embedding's."""
    torch.manual_seed(1234)
    layers = nn.Sequential(TokenAndPosition(VOCAB, WIDTH, LENGTH), *[CausalBlock(WIDTH) for _ in range(blocks)], NormAndHead(WIDTH, VOCAB))
    layers[-1].head.weight = layers[0].tok.weight
    return layers.double()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return toy_models.token_batch(step, rows=12, length=LENGTH, vocab=VOCAB)


class TiedGPTModule(LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.layers = tied_gpt_layers()
        self.lr = lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = gpt_loss(self(tokens), targets)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def gpt_loader(batches: int = 3) -> DataLoader:
    """The batches of ``gpt_batch`` in order; a resumed run continues where its checkpoint
    left the epoch (a plain DataLoader would restart it)."""
    tokens, targets = zip(*(gpt_batch(step) for step in range(batches)))
    return ResumableDataLoader(TensorDataset(torch.cat(tokens), torch.cat(targets)), batch_size=12)


def single_device_states(steps: int, clip: float, batches: int = 3) -> list[dict[str, torch.Tensor]]:
    """Plain training of ``TiedGPTModule`` (Adam, clipping by norm), epoch after epoch over
    ``batches`` batches: the state dict after every step."""
    model = TiedGPTModule()
    opt = torch.optim.Adam(model.parameters(), lr=model.lr)
    loader = list(gpt_loader(batches))
    states = []
    for step in range(steps):
        tokens, targets = loader[step % batches]
        opt.zero_grad()
        gpt_loss(model(tokens), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        states.append({key: value.detach().clone() for key, value in model.state_dict().items()})
    return states
