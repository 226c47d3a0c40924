"""DAPPLE's benchmark models (DAPPLE Table 1) as layer-chain LightningModules.

``MODELS`` maps a short name to the class; ``PAPER_KWARGS`` gives the full sizes of the
paper's models and ``TINY_KWARGS`` variants that train on two CPU cores in seconds (pair
them with the ``TINY_DATA_KWARGS`` of ``lightning_dapple.data``).
"""
from __future__ import annotations

from typing import Any

from lightning_dapple.models.bert import BertMLM
from lightning_dapple.models.common import SequentialLightningModule, count_parameters
from lightning_dapple.models.gnmt import GNMT
from lightning_dapple.models.vgg import VGG19

__all__ = [
    "MODELS", "PAPER_KWARGS", "TINY_KWARGS", "BertMLM", "GNMT", "VGG19", "SequentialLightningModule", "count_parameters",
    "paper_model", "tiny_model", "bert48", "gnmt16", "vgg19", "tiny_bert", "tiny_gnmt", "tiny_vgg",
]

MODELS: dict[str, type[SequentialLightningModule]] = {"bert": BertMLM, "gnmt": GNMT, "vgg": VGG19}

# Full sizes of DAPPLE Table 1 (BERT-48, GNMT-16, VGG-19). GNMT-16 reaches the paper's
# 291M with the 36548-word WMT16 BPE vocabulary (276.7M with the 32000 default).
PAPER_KWARGS: dict[str, dict[str, Any]] = {
    "bert": {"vocab_size": 30522, "hidden": 1024, "layers": 48, "heads": 16, "ffn": 4096, "seq_len": 128},
    "gnmt": {"vocab_size": 36548, "hidden": 1024, "encoder_layers": 8, "decoder_layers": 8},
    "vgg": {"num_classes": 1000, "width_multiplier": 1.0, "image_size": 224, "fc_hidden": 4096},
}

# Tiny variants measured to learn their synthetic task on 2 CPU cores (see tests/test_models.py).
TINY_KWARGS: dict[str, dict[str, Any]] = {
    "bert": {"vocab_size": 64, "hidden": 64, "layers": 2, "heads": 2, "ffn": 128, "seq_len": 16, "dropout": 0.0, "lr": 3e-3},
    "gnmt": {"vocab_size": 32, "hidden": 64, "encoder_layers": 2, "decoder_layers": 2, "dropout": 0.0, "src_len": 8, "tgt_len": 9, "lr": 1e-2},
    "vgg": {"num_classes": 4, "width_multiplier": 1 / 16, "image_size": 32, "fc_hidden": 64, "dropout": 0.0, "optimizer": "adam", "lr": 1e-3, "weight_decay": 0.0},
}


def paper_model(name: str, **overrides: Any) -> SequentialLightningModule:
    """The full-size model of DAPPLE Table 1 (``name`` in ``MODELS``)."""
    return MODELS[name](**{**PAPER_KWARGS[name], **overrides})


def tiny_model(name: str, **overrides: Any) -> SequentialLightningModule:
    """The tiny CPU variant (``name`` in ``MODELS``)."""
    return MODELS[name](**{**TINY_KWARGS[name], **overrides})


# No-argument factories, e.g. ``dapple-profile --model lightning_dapple.models:tiny_bert``.
def bert48() -> BertMLM:
    return paper_model("bert")  # type: ignore[return-value]


def gnmt16() -> GNMT:
    return paper_model("gnmt")  # type: ignore[return-value]


def vgg19() -> VGG19:
    return paper_model("vgg")  # type: ignore[return-value]


def tiny_bert() -> BertMLM:
    return tiny_model("bert")  # type: ignore[return-value]


def tiny_gnmt() -> GNMT:
    return tiny_model("gnmt")  # type: ignore[return-value]


def tiny_vgg() -> VGG19:
    return tiny_model("vgg")  # type: ignore[return-value]
