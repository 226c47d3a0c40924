"""Tiny models for equivalence tests: an MLP and a transformer passing a mask between layers."""
from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def mlp_layers(sizes=(6, 10, 12, 10, 8, 3)) -> nn.Sequential:
    """Five layers; the last is a plain Linear head."""
    layers = [Block(a, b) for a, b in zip(sizes[:-2], sizes[1:-1])]
    layers.append(nn.Linear(sizes[-2], sizes[-1]))
    return nn.Sequential(*layers)


class Embed(nn.Module):
    """Token ids -> {'h': embeddings, 'mask': padding mask}; the mask needs no gradient."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": self.embedding(tokens), "mask": tokens == 0}


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.norm2 = nn.LayerNorm(width)

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, mask = state["h"], state["mask"]
        attended, _ = self.attention(h, h, h, key_padding_mask=mask, need_weights=False)
        h = self.norm1(h + attended)
        h = self.norm2(h + self.ff(h))
        return {"h": h, "mask": mask}


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, vocab)

    def forward(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(state["h"])


def transformer_layers(vocab: int = 11, width: int = 8, blocks: int = 3) -> nn.Sequential:
    return nn.Sequential(Embed(vocab, width), *[EncoderBlock(width) for _ in range(blocks)], Head(width, vocab))


def mlp_batch(step: int, rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 3, generator=g, dtype=torch.float64)
    return x, y


def token_batch(step: int, rows: int = 12, length: int = 5, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(1, vocab, (rows, length), generator=g)
    tokens[:, -1] = 0  # padding the mask must hide
    tokens[0, -2] = 0
    targets = torch.randint(0, vocab, (rows, length), generator=g)
    return tokens, targets
