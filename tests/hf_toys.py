"""Hugging Face models as people wrap them in a LightningModule, in tiny sizes built from
configs (nothing is downloaded), and padded batches for them."""
from __future__ import annotations

import json
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule

VOCAB, LENGTH, ROWS = 32, 6, 4


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )


def gpt2_config(dropout: float = 0.0) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=4, n_head=4, n_positions=64, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)


def bert_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=4, intermediate_size=32, max_position_embeddings=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3,
    )


class LitLM(LightningModule):
    """The issue's module: a causal LM from a config (or a directory), called by keyword."""

    def __init__(self, config: Any = None, directory: str | None = None, seed: int = 7) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(directory) if directory else AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, i):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LitLMOnMeta(LitLM):
    """The causal LM made in ``configure_model`` from its config, or from a directory's
    config (``AutoConfig.from_pretrained``): built on the meta device under the strategy,
    its weights then the seed's or, with ``DappleStrategy(pretrained=directory)``, the
    directory's."""

    def __init__(self, config: Any = None, directory: str | None = None, seed: int = 7) -> None:
        LightningModule.__init__(self)
        self.source = (config, directory, seed)

    def configure_model(self) -> None:
        if hasattr(self, "model"):  # configure_model runs again for validate after fit
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        config, directory, seed = self.source
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory) if directory else config)


class LitClassifier(LightningModule):
    """A sequence classifier (BERT) called with input_ids, attention_mask and labels."""

    def __init__(self, config: Any, seed: int = 7) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        torch.manual_seed(seed)
        self.model = AutoModelForSequenceClassification.from_config(config)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    def training_step(self, batch, i):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def lm_batches(count: int = 3, seed: int = 0, rows: int = ROWS) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows (attention_mask 0 at the end of some rows: one position in rows
    1, 5, ..., two in rows 2, 6, ...), labels -100 on the last 2 positions of every row
    (each padded position among them), so every row has the same number of ignored labels
    and HF's token-mean loss is a mean over rows."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=g)
        mask = torch.ones(rows, LENGTH, dtype=torch.long)
        mask[1::4, -1:] = 0
        mask[2::4, -2:] = 0
        labels = ids.clone()
        labels[:, -2:] = -100
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def classification_batches(count: int = 3, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
        mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
        mask[0, -2:] = 0
        mask[3, -1:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (ROWS,), generator=g)})
    return batches


def decoder_config(model_type: str) -> Any:
    """A tiny config of a Llama-shaped decoder family (Mistral with a sliding window,
    Qwen2 with one sliding-window block)."""
    from transformers import AutoConfig

    extra: dict[str, Any] = {}
    if model_type == "mistral":
        extra = {"sliding_window": 3}
    if model_type == "qwen2":
        extra = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2, "layer_types": ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]}
    return AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=4, max_position_embeddings=64, tie_word_embeddings=False, **extra,
    )


class LitLMReturningTheLoss(LitLM):
    """Glue after the call (``.loss``) and the model called with input_ids by position."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss

    def training_step(self, batch, i):
        return self(**batch)


class LitLMComputingItsMask(LitLM):
    """Computes an argument of the call itself: not a call with forward's own arguments."""

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.model(input_ids=input_ids, attention_mask=(input_ids > 0).long(), labels=labels)


class RecomputeCounter(Callback):
    """Writes, per rank, how many micro-batches its stage recomputed in each step to
    ``<directory>/recomputed_rank<r>.json``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.counts: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append(trainer.strategy.runner.stats.recomputed)

    def on_train_end(self, trainer, pl_module) -> None:
        with open(f"{self.directory}/recomputed_rank{trainer.global_rank}.json", "w") as stream:
            json.dump(self.counts, stream)


class LitLMPerSequenceMean(LitLM):
    """The model called without labels; the loss is each sequence's token mean over its
    real labels, then the mean over the sequences: a mean over samples under any padding."""

    def training_step(self, batch, i):
        import torch.nn.functional as F

        logits = self(batch["input_ids"], batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        real = (labels != -100).to(token.dtype)
        return ((token * real).sum(1) / real.sum(1)).mean()
