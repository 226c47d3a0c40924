"""Generated data sets (or small real files) for the benchmark models, as LightningDataModules.

``DATAMODULES`` maps a data set name to its class; ``FOR_MODEL`` names the data set each
entry of ``lightning_dapple.models.MODELS`` trains on; ``TINY_DATA_KWARGS`` matches the
tiny model variants of ``lightning_dapple.models.TINY_KWARGS``.
"""
from __future__ import annotations

from typing import Any

from lightning_dapple.data.synthetic import MaskedLMDataModule, ShapesDataModule, TranslationDataModule

__all__ = ["DATAMODULES", "FOR_MODEL", "TINY_DATA_KWARGS", "MaskedLMDataModule", "ShapesDataModule", "TranslationDataModule"]

DATAMODULES: dict[str, type] = {"mlm": MaskedLMDataModule, "translation": TranslationDataModule, "shapes": ShapesDataModule}

FOR_MODEL: dict[str, str] = {"bert": "mlm", "gnmt": "translation", "vgg": "shapes"}

TINY_DATA_KWARGS: dict[str, dict[str, Any]] = {
    "mlm": {"vocab_size": 64, "seq_len": 16, "num_masks": 2, "batch_size": 32},
    "translation": {"vocab_size": 32, "src_len": 8, "batch_size": 32},
    "shapes": {"num_classes": 4, "image_size": 32, "batch_size": 32},
}
