"""Cutting a global batch into micro-batches and micro-batches into per-replica slices.

DAPPLE splits the global batch into M micro-batches and, on a stage replicated r ways,
each micro-batch further into r even slices (5.2.2, Fig. 8a). Row ranges are computed
the same way everywhere (``floor(k * n / parts)``), so every rank knows which rows any
other rank holds without asking, and split-concat transfers are the overlaps of ranges.

Batches and boundary activations are arbitrary nests (tensor, tuple, list, dict); every
tensor leaf is batch-first, or whole: a 0-d tensor or a first dimension of 1 beside a larger
batch (``profile.sample_rows``), which is never cut and reaches every slice as it is.
``torch.utils._pytree`` flattens them for transport.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile.sample_rows import batch_rows


def row_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open rows of part ``index`` when ``total`` rows are cut into ``parts``."""
    return (index * total) // parts, ((index + 1) * total) // parts


def microbatch_rows(batch_size: int, micro_batches: int, microbatch: int) -> tuple[int, int]:
    return row_range(batch_size, micro_batches, microbatch)


def slice_rows(batch_size: int, micro_batches: int, microbatch: int, replicas: int, replica: int) -> tuple[int, int]:
    """Rows of the global batch that ``replica`` of a stage with ``replicas`` handles."""
    lo, hi = microbatch_rows(batch_size, micro_batches, microbatch)
    a, b = row_range(hi - lo, replicas, replica)
    return lo + a, lo + b


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else None


_PER_SAMPLE = (str, bytes, int, float, bool, type(None))  # items a list holds one per sample (ids, texts)


def _tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a batch: inside tuples, lists, dicts (and their subclasses, such as a
    NamedTuple or Hugging Face's BatchEncoding) and dataclasses, as Lightning's
    ``move_data_to_device`` finds them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensor_leaves(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensor_leaves(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensor_leaves(getattr(value, field.name))


def batch_size_of(batch: Any) -> int:
    """Rows of a batch: the first dimension of its first tensor leaf with more than one row
    (``sample_rows.batch_rows``), so a leading (1, ...) table is not taken for the batch."""
    rows = batch_rows(_tensor_leaves(batch))
    if rows is None:
        raise DappleConfigError("batch", "contains no tensor with a batch dimension", "return tensors (batch first) from the DataLoader")
    return rows


def take_rows(batch: Any, lo: int, hi: int) -> Any:
    """The rows ``[lo, hi)`` of every batch-first tensor leaf; other leaves (whole values:
    0-d, or a first dimension of 1 beside a larger batch) pass unchanged.

    A list of per-sample items of the batch's length (strings, ids: what the default collate
    makes of them) is cut too, so a step computing with ``len(ids)`` or looking weights up
    by id sees its own rows. Tuples, lists, dicts and dataclasses are rebuilt as their type.
    """
    if type(batch) in (tuple, list) and batch and all(type(leaf) is torch.Tensor and leaf.dim() > 0 for leaf in batch):
        size = batch[0].shape[0]
        if all(leaf.shape[0] == size for leaf in batch):  # the common (x, y) batch: no tree walk per micro-batch
            return type(batch)(leaf[lo:hi] for leaf in batch)
    return _cut(batch, lo, hi, batch_size_of(batch))


def _cut(value: Any, lo: int, hi: int, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[lo:hi] if value.dim() > 0 and value.shape[0] == size else value
    if type(value) in (list, tuple) and len(value) == size and all(isinstance(item, _PER_SAMPLE) for item in value):
        return value[lo:hi]  # the default collate gives strings as a tuple, a custom one often a list
    if isinstance(value, tuple):
        items = [_cut(item, lo, hi, size) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return type(value)(_cut(item, lo, hi, size) for item in value)
    if isinstance(value, Mapping):
        cut = {key: _cut(item, lo, hi, size) for key, item in value.items()}
        return cut if type(value) is dict else type(value)(cut)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _cut(getattr(value, f.name), lo, hi, size) for f in dataclasses.fields(value) if f.init})
    return value


def flatten(structure: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensor leaves and a spec to rebuild the nest; non-tensor leaves are refused."""
    leaves, spec = pytree.tree_flatten(structure)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise DappleConfigError(
                "layer output",
                f"contains a {type(leaf).__name__} leaf; only tensors can pass between pipeline stages",
                "return a tensor, or a tuple/dict of tensors, from every layer",
            )
    return leaves, spec


def unflatten(leaves: list[torch.Tensor], spec: Any) -> Any:
    return pytree.tree_unflatten(leaves, spec)
