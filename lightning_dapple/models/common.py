"""Pieces shared by the benchmark models: the layer-sequence base class and the loss.

Every benchmark model follows the convention the pipeline runtime relies on
(``lightning_dapple.strategy.module_adapter``): all parameters live in ``self.layers`` (an
``nn.Sequential``), ``forward`` applies those layers in order, each layer gets ONE argument
(whatever the previous layer returned) and returns batch-first tensors only.

Losses are means over samples of a per-sample quantity, so the mean over a batch equals
the row-weighted mean of the losses of any slicing of it; DAPPLE splits a global batch
into micro-batches and, on replicated stages, into per-replica slices (DAPPLE 5.2.2) and
recombines their gradients weighted by rows.
"""
from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_dapple.errors import require

# Token ids shared with ``lightning_dapple.data.synthetic``.
PAD_ID = 0
UNK_ID = 1
BOS_ID = 2
EOS_ID = 3
MASK_ID = 4
FIRST_WORD_ID = 5
IGNORE_INDEX = -100


class SequentialLightningModule(L.LightningModule):
    """A LightningModule whose forward is its layer sequence ``self.layers`` applied in order.

    Subclasses build ``self.layers`` in ``__init__`` and set ``example_input_array``.
    """

    layers: nn.Sequential

    @override
    def forward(self, x: Any) -> Any:
        # Exactly the layer chain: each layer gets what the previous one returned, unpacked
        # never. The pipeline runtime replaces this method by per-stage execution.
        return self.layers(x)


class ClassifierSteps:
    """Training/validation/predict steps of a model whose batch is ``(inputs, labels)``
    and whose output is class logits: the loss (``self.loss``), accuracy metrics
    ``self.train_acc``/``self.val_acc`` on the argmax, logged as Lightning code does."""

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        inputs, labels = batch
        logits = self(inputs)
        loss = self.loss(logits, labels)
        self.log(f"{stage}_loss", loss, prog_bar=True)
        metric = getattr(self, f"{stage}_acc")
        metric(logits.argmax(-1), labels)
        self.log(f"{stage}_acc", metric, prog_bar=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "val")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Predicted ids: the argmax over the last dimension of the logits."""
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(inputs).argmax(-1)


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements (works on meta-device models)."""
    return sum(p.numel() for p in module.parameters())


def per_sample_token_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean over samples of each sample's mean cross-entropy over its non-ignored positions.

    ``logits`` is (B, T, V), ``targets`` (B, T). Each sample is normalised by its own count
    of scored tokens (fixed by the data: a fixed number of masks, or a fixed target
    length), never by a count over the whole batch, so the loss of a batch is the
    row-weighted mean of the losses of its slices. A sample with no scored token adds 0.
    """
    rows, length = targets.shape
    token_loss = F.cross_entropy(
        logits.reshape(rows * length, -1), targets.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(rows, length)
    scored = (targets != ignore_index).to(token_loss.dtype)
    per_sample = (token_loss * scored).sum(dim=1) / scored.sum(dim=1).clamp_min(1.0)
    return per_sample.mean()


def example_tokens(rows: int, length: int, vocab_size: int) -> torch.Tensor:
    """Deterministic word ids (no RNG use, works under ``torch.device('meta')``)."""
    words = max(vocab_size - FIRST_WORD_ID, 1)
    return torch.arange(rows * length).view(rows, length) % words + FIRST_WORD_ID


def check_positive(**values: float) -> None:
    for name, value in values.items():
        require(value > 0, name, f"must be positive, got {value!r}", f"pass {name} > 0")


def check_dropout(dropout: float) -> None:
    require(0.0 <= dropout < 1.0, "dropout", f"must be in [0, 1), got {dropout!r}", "pass e.g. 0.1, or 0 to disable")


def ids_to_text(ids: list[int], stop: int = EOS_ID, skip: tuple[int, ...] = (PAD_ID, BOS_ID)) -> str:
    """A decoded id sequence as a space-separated string, cut at the first ``stop`` id."""
    words = []
    for token in ids:
        if token == stop:
            break
        if token not in skip:
            words.append(str(token))
    return " ".join(words)
