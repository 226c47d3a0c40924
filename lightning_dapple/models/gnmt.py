"""GNMT (Wu et al. 2016) as a chain of pipeline layers: one LSTM layer per pipeline layer.

GNMT-16 is one of DAPPLE's benchmark models (DAPPLE Table 1: 291M parameters, profiled at
batch 64; Table 4 plans it with GBS 1024 and a 9:7 split, which the arXiv version, sec.
VI-C, explains by decoder layers costing about 1.45x an encoder layer). Layers::

    0              GNMTEmbedding   (src ids (B, S), tgt_in ids (B, T))
                                   -> {src: (B, S, H), src_mask: (B, S), tgt: (B, T, H)}
    1              EncoderLayer    bidirectional LSTM, src -> (B, S, 2H)
    2 .. E         EncoderLayer    LSTM, src -> (B, S, H); residual from encoder layer 3 on
    E + 1          AttentionDecoderLayer
                                   LSTM over tgt; attention of its outputs over the final
                                   encoder states -> {h: (B, T, H), ctx: (B, T, H)}
    E + 2 .. E + D DecoderLayer    LSTM over [h; ctx] -> {h, ctx}; residual from decoder layer 3 on
    E + D + 1      GNMTOutput      h -> logits (B, T, V)

As in GNMT, attention is computed once, from the output of the bottom decoder layer, and
its context is fed to every higher decoder layer (so decoder layers see inputs of 2H and
cost ~1.5x an encoder layer, matching DAPPLE's 1:1.45). The encoder states and source
mask therefore travel only up to the first decoder layer; after it only ``h`` and ``ctx``
cross stage boundaries. The target embeddings are computed in layer 0 and carried through
the encoder layers. Decoder LSTMs start from zero states (no encoder final states are
passed), and LSTMs run over padded sequences without packing (padding is masked in the
attention and ignored in the loss). Dropout is applied to the input of every LSTM layer
and of the output projection.

Parameter count: with the default 32000-word vocabulary the full model has 276.7M
parameters; with a 36548-word vocabulary (the size of a shared ~32k-merge BPE vocabulary
for WMT16 En-De) it has 290.7M, DAPPLE's 291M (``PAPER_KWARGS['gnmt']``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import BLEUScore
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.models.common import (
    BOS_ID,
    PAD_ID,
    SequentialLightningModule,
    check_dropout,
    check_positive,
    example_tokens,
    ids_to_text,
    per_sample_token_loss,
)

State = dict[str, torch.Tensor]


class GNMTEmbedding(nn.Module):
    """Separate source and target embeddings; emits the source padding mask (True = pad)."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.src = nn.Embedding(vocab_size, hidden)
        self.tgt = nn.Embedding(vocab_size, hidden)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> State:
        src_ids, tgt_ids = inputs
        return {"src": self.src(src_ids), "src_mask": src_ids == PAD_ID, "tgt": self.tgt(tgt_ids)}


class EncoderLayer(nn.Module):
    """One encoder LSTM layer over ``state['src']``; other entries pass through."""

    def __init__(self, input_size: int, hidden: int, dropout: float, bidirectional: bool = False, residual: bool = False) -> None:
        super().__init__()
        require(not (residual and (bidirectional or input_size != hidden)), "EncoderLayer", "residual needs input == output size", "use residual only from layer 3 on")
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(input_size, hidden, batch_first=True, bidirectional=bidirectional)
        self.residual = residual

    def forward(self, state: State) -> State:
        x = state["src"]
        out, _ = self.lstm(self.dropout(x))
        return {**state, "src": x + out if self.residual else out}


class AdditiveAttention(nn.Module):
    """Bahdanau attention score ``v . tanh(W_q q + W_k k)``, masked softmax over the source."""

    def __init__(self, query_size: int, key_size: int, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(query_size, hidden, bias=False)
        self.key = nn.Linear(key_size, hidden)
        self.score = nn.Linear(hidden, 1, bias=False)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, key_pad_mask: torch.Tensor) -> torch.Tensor:
        # (B, T, 1, A) + (B, 1, S, A) -> scores (B, T, S)
        scores = self.score(torch.tanh(self.query(queries).unsqueeze(2) + self.key(keys).unsqueeze(1))).squeeze(-1)
        scores = scores.masked_fill(key_pad_mask.unsqueeze(1), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), keys)


class AttentionDecoderLayer(nn.Module):
    """Bottom decoder LSTM over the target embeddings, then attention over the encoder output."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = AdditiveAttention(hidden, hidden, hidden)

    def forward(self, state: State) -> State:
        h, _ = self.lstm(self.dropout(state["tgt"]))
        ctx = self.attention(h, state["src"], state["src_mask"])
        return {"h": h, "ctx": ctx}


class DecoderLayer(nn.Module):
    """A higher decoder LSTM layer fed ``[h; ctx]``; the attention context passes along."""

    def __init__(self, hidden: int, dropout: float, residual: bool) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(2 * hidden, hidden, batch_first=True)
        self.residual = residual

    def forward(self, state: State) -> State:
        h, ctx = state["h"], state["ctx"]
        out, _ = self.lstm(self.dropout(torch.cat([h, ctx], dim=-1)))
        return {"h": h + out if self.residual else out, "ctx": ctx}


class GNMTOutput(nn.Module):
    def __init__(self, hidden: int, vocab_size: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.projection = nn.Linear(hidden, vocab_size)

    def forward(self, state: State) -> torch.Tensor:
        return self.projection(self.dropout(state["h"]))


class GNMT(SequentialLightningModule):
    """GNMT with ``encoder_layers`` + ``decoder_layers`` LSTM layers; the default is GNMT-16 (DAPPLE Table 1).

    Batches are ``(src_ids, tgt_in_ids, tgt_out_ids)`` of fixed lengths (padding id 0);
    ``tgt_in`` starts with BOS and ``tgt_out`` is it shifted by one, ending in EOS. The
    model input is the pair ``(src_ids, tgt_in_ids)`` (teacher forcing). The loss is each
    sample's mean token cross-entropy over its non-padding target positions (all of them
    for fixed-length data), averaged over samples. Validation logs token accuracy and
    BLEU of the teacher-forced argmax predictions; ``translate`` decodes greedily (single
    process only). ``src_len``/``tgt_len`` only size ``example_input_array``. Tiny variant:
    ``GNMT(vocab_size=32, hidden=64, encoder_layers=2, decoder_layers=2, dropout=0, lr=1e-2)``.
    """

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden: int = 1024,
        encoder_layers: int = 8,
        decoder_layers: int = 8,
        dropout: float = 0.2,
        src_len: int = 50,
        tgt_len: int = 50,
        residual_from: int = 3,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        init_range: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_positive(vocab_size=vocab_size, hidden=hidden, decoder_layers=decoder_layers, src_len=src_len, tgt_len=tgt_len, lr=lr)
        check_dropout(dropout)
        require(encoder_layers >= 2, "encoder_layers", f"must be >= 2, got {encoder_layers}", "the bottom layer is bidirectional; use 2 or more")
        require(residual_from >= 3, "residual_from", f"must be >= 3, got {residual_from}", "layers 1-2 change width; GNMT starts residuals at 3")
        encoder = [EncoderLayer(hidden, hidden, dropout, bidirectional=True), EncoderLayer(2 * hidden, hidden, dropout)]
        encoder += [EncoderLayer(hidden, hidden, dropout, residual=i >= residual_from) for i in range(3, encoder_layers + 1)]
        decoder: list[nn.Module] = [AttentionDecoderLayer(hidden, dropout)]
        decoder += [DecoderLayer(hidden, dropout, residual=i >= residual_from) for i in range(2, decoder_layers + 1)]
        self.layers = nn.Sequential(GNMTEmbedding(vocab_size, hidden), *encoder, *decoder, GNMTOutput(hidden, vocab_size, dropout))
        # GNMT initialises every parameter uniformly in [-0.1, 0.1].
        for parameter in self.layers.parameters():
            nn.init.uniform_(parameter, -init_range, init_range)
        self.train_acc = MulticlassAccuracy(vocab_size, ignore_index=PAD_ID, average="micro")
        self.val_acc = MulticlassAccuracy(vocab_size, ignore_index=PAD_ID, average="micro")
        self.val_bleu = BLEUScore(n_gram=4)
        self.example_input_array = (example_tokens(2, src_len, vocab_size), example_tokens(2, tgt_len, vocab_size))

    @override
    def forward(self, *inputs: Any) -> Any:
        # The input is one (src_ids, tgt_in_ids) pair; ``self(src, tgt)`` is accepted too
        # because Lightning's ModelSummary unpacks a tuple example_input_array into
        # positional arguments (the pipeline runtime packs them back the same way).
        x = inputs[0] if len(inputs) == 1 else inputs
        return self.layers(x)

    def loss(self, logits: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        return per_sample_token_loss(logits, tgt_out, PAD_ID)

    @override
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        src, tgt_in, tgt_out = batch
        logits = self((src, tgt_in))
        loss = self.loss(logits, tgt_out)
        self.log("train_loss", loss, prog_bar=True)
        self.train_acc(logits.argmax(-1), tgt_out)
        self.log("train_acc", self.train_acc, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        src, tgt_in, tgt_out = batch
        logits = self((src, tgt_in))
        loss = self.loss(logits, tgt_out)
        predicted = logits.argmax(-1)
        self.log("val_loss", loss, prog_bar=True)
        self.val_acc(predicted, tgt_out)
        self.log("val_acc", self.val_acc, prog_bar=True)
        hypotheses = [ids_to_text(row) for row in predicted.tolist()]
        references = [[ids_to_text(row)] for row in tgt_out.tolist()]
        self.val_bleu(hypotheses, references)
        self.log("val_bleu", self.val_bleu, prog_bar=True)
        return loss

    @override
    def predict_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Teacher-forced argmax ids (B, T)."""
        src, tgt_in = batch[0], batch[1]
        return self((src, tgt_in)).argmax(-1)

    @torch.no_grad()
    def translate(self, src: torch.Tensor, max_len: int) -> torch.Tensor:
        """Greedy decoding (B, max_len), re-running the whole model per step (single process only)."""
        tgt = torch.full((src.shape[0], 1), BOS_ID, dtype=torch.long, device=src.device)
        for _ in range(max_len):
            step = self.layers((src, tgt))[:, -1].argmax(-1, keepdim=True)
            tgt = torch.cat([tgt, step], dim=1)
        return tgt[:, 1:]

    @override
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

