"""Which layers draw random numbers when they train: dropout of any kind.

A step that calls ``self(x)`` twice on one input expects two dropout samples (R-Drop's
consistency term between them). On a pipeline the layers before the last stage run once
per micro-batch, so both calls share their draws, and only the last stage's differ: the
term would silently lose what the earlier stages contribute. Knowing which layers draw lets
the last stage refuse such a second call (``stage.guard_calls``).
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

__all__ = ["draws_random"]


def draws_random(layers: Iterable[nn.Module]) -> bool:
    """Whether any of ``layers`` holds a dropout module with p > 0, or an attention module
    with attention dropout (``nn.MultiheadAttention(dropout=...)``)."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                return True
            if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
                return True
    return False
