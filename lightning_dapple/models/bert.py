"""BERT trained with masked language modelling, as a chain of pipeline layers.

BERT-48 is one of DAPPLE's benchmark models (DAPPLE Table 1: 640M parameters, profiled at
batch 2; planned with GBS 64 in Table 4): BERT-Large blocks (hidden 1024, 16 heads, FFN
4096) stacked 48 deep. The layers here are::

    0          BertEmbeddings  token ids (B, T)          -> (hidden (B, T, H), pad mask (B, T))
    1 .. L     BertBlock       (hidden, pad mask)        -> (hidden, pad mask)
    L + 1      MLMHead         (hidden, pad mask)        -> logits (B, T, V)

The padding mask (``True`` at padding id 0) travels with the hidden states between
stages; it needs no gradient. Token-type embeddings are left out (one segment per
sequence). The MLM decoder's weight is the token embedding's, as in BERT, so the
full-size model has 637.5M parameters (DAPPLE counts ~640M). Layer 0 and the last layer
then share a parameter: a plan that puts them on different stages keeps a copy on each
and sums their gradients over both (``execute/tied.py``).
"""
from __future__ import annotations

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.models.common import (
    IGNORE_INDEX,
    PAD_ID,
    ClassifierSteps,
    SequentialLightningModule,
    check_dropout,
    check_positive,
    example_tokens,
    per_sample_token_loss,
)

Hidden = tuple[torch.Tensor, torch.Tensor]


class BertEmbeddings(nn.Module):
    """Token + learned position embeddings, LayerNorm, dropout; emits the padding mask too."""

    def __init__(self, vocab_size: int, hidden: int, max_positions: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(max_positions, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> Hidden:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(positions).unsqueeze(0)
        return self.dropout(self.norm(hidden)), input_ids == PAD_ID


class BertBlock(nn.Module):
    """Post-LN transformer encoder block (BERT): self-attention and a GELU FFN, each residual."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(hidden, heads, dropout=dropout, batch_first=True)
        self.attention_dropout = nn.Dropout(dropout)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden), nn.Dropout(dropout))
        self.ffn_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, state: Hidden) -> Hidden:
        hidden, pad_mask = state
        attended, _ = self.attention(hidden, hidden, hidden, key_padding_mask=pad_mask, need_weights=False)
        hidden = self.attention_norm(hidden + self.attention_dropout(attended))
        hidden = self.ffn_norm(hidden + self.ffn(hidden))
        return hidden, pad_mask


class MLMHead(nn.Module):
    """Dense + GELU + LayerNorm, then a decoder to vocabulary logits; ``BertMLM`` makes the
    decoder's weight the token embedding's (tied, as BERT does), its bias its own."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.transform = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=1e-12))
        self.decoder = nn.Linear(hidden, vocab_size)

    def forward(self, state: Hidden) -> torch.Tensor:
        hidden, _ = state
        return self.decoder(self.transform(hidden))


class BertMLM(ClassifierSteps, SequentialLightningModule):
    """BERT with an MLM head; the default is BERT-48 of DAPPLE Table 1 (hidden 1024, 48 layers, 16 heads).

    Batches are ``(input_ids, labels)``: ``input_ids`` (B, T) with ``[MASK]`` at a fixed
    number of positions per sequence and padding id 0, ``labels`` (B, T) holding the
    original id at masked positions and -100 elsewhere. The loss is each sample's mean
    cross-entropy over its masked positions, averaged over samples. Tiny variant:
    ``BertMLM(vocab_size=64, hidden=64, layers=2, heads=2, ffn=128, seq_len=16, dropout=0,
    lr=3e-3)``. Optimiser: AdamW (DAPPLE trains BERT-48 with Adam). ``seq_len`` sizes
    ``example_input_array``; any length up to ``max_positions`` runs.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        hidden: int = 1024,
        layers: int = 48,
        heads: int = 16,
        ffn: int = 4096,
        seq_len: int = 128,
        max_positions: int = 512,
        dropout: float = 0.1,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_positive(vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads, ffn=ffn, seq_len=seq_len, lr=lr)
        check_dropout(dropout)
        require(hidden % heads == 0, "hidden", f"{hidden} is not divisible by heads={heads}", "pick hidden a multiple of heads")
        require(
            seq_len <= max_positions,
            "seq_len",
            f"{seq_len} exceeds max_positions={max_positions}",
            "raise max_positions or shorten the sequences",
        )
        self.layers = nn.Sequential(
            BertEmbeddings(vocab_size, hidden, max_positions, dropout),
            *[BertBlock(hidden, heads, ffn, dropout) for _ in range(layers)],
            MLMHead(hidden, vocab_size),
        )
        self._init_weights()
        self.layers[-1].decoder.weight = self.layers[0].tokens.weight  # tied, as in BERT
        self.train_acc = MulticlassAccuracy(vocab_size, ignore_index=IGNORE_INDEX, average="micro")
        self.val_acc = MulticlassAccuracy(vocab_size, ignore_index=IGNORE_INDEX, average="micro")
        self.example_input_array = example_tokens(2, seq_len, vocab_size)

    def _init_weights(self) -> None:
        # BERT's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm.
        for module in self.layers.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.MultiheadAttention):
                nn.init.normal_(module.in_proj_weight, std=0.02)
                nn.init.zeros_(module.in_proj_bias)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return per_sample_token_loss(logits, labels, IGNORE_INDEX)

    @override
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
