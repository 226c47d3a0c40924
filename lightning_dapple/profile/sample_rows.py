"""Which tensors of a batch or a layer output hold one row per sample, and which are whole.

Micro-batching (GPipe 2.2) and split-concat (DAPPLE 5.2.2) cut every tensor that holds one
row per sample along its first dimension. Models also pass values that are the same for
every sample: a rotary table of shape (1, T, n) handed to every block, an attention mask
of shape (1, 1, T, T), a 0-d scale. Such a value is *whole*: it is never cut; every device
that runs some rows of a micro-batch needs all of it once.

The rule, beside ``rows`` rows of per-sample data:

* a 0-d tensor is whole;
* a tensor whose first dimension is 1 is whole when ``rows`` > 1;
* every other tensor is per-sample (a first dimension other than ``rows`` is the caller's
  error to report).

With ``rows`` == 1 a first dimension of 1 fits both readings; the rule calls it per-sample
and the transport settles what the receiver makes of it (``execute/transfer/transport.py``). The
profiler, the batch slicing and the transport all decide with this module, so a cut's
fixed bytes in a profile are the bytes the executor sends whole.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["is_whole", "batch_rows", "split_bytes"]


def is_whole(shape: Sequence[int], rows: int) -> bool:
    """Whether a tensor of ``shape`` beside ``rows`` per-sample rows is one value for all of
    them (module docstring)."""
    return len(shape) == 0 or (shape[0] == 1 and rows > 1)


def batch_rows(tensors: Iterable[torch.Tensor]) -> int | None:
    """Rows of a batch: the first dimension of its first tensor with more than one row, else
    1 if some tensor has a first dimension; None when every tensor is 0-d. A leading (1, ...)
    table does not make a batch of one."""
    found = None
    for tensor in tensors:
        if tensor.dim() > 0:
            if tensor.shape[0] > 1:
                return int(tensor.shape[0])
            found = 1 if found is None else found
    return found


def split_bytes(tensors: Iterable[torch.Tensor], rows: int) -> tuple[int, int]:
    """(per-sample bytes, whole bytes) of ``tensors`` beside ``rows`` per-sample rows; a
    tensor listed twice counts once."""
    seen: set[int] = set()
    per_sample = whole = 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        if is_whole(tensor.shape, rows):
            whole += size
        else:
            per_sample += size
    return per_sample, whole
