"""One rule for "stashed bytes", shared by the profiler and the executor.

DAPPLE's memory argument (3.2, 5.3) is about the activations each in-flight micro-batch
keeps from its forward until its backward. We measure them with autograd's
saved-tensor hooks: every tensor saved for backward counts with its own bytes (a batch
slice or a view into a receive buffer counts as its rows, not as the whole buffer it
lives in), memory saved twice counts once (the same view, or a contiguous reshape of it:
``Linear`` saves its 3-d input flattened), parameters not at all.

The executor meters a stage's layers together, so a tensor two consecutive layers save
(a ``ReLU``'s output, which the next ``Linear`` saves as its input) counts once. The
profiler meters each layer alone, and records the part of a layer's stash that is the
previous layer's output saved by both (``shared_views``; ``stash_shared_bytes`` in the
profile; ``stash_shared_whole_bytes`` for a whole value such as a rotary table that each
layer saves and passes on), which ``model_profile.stash_span_bytes`` counts once inside a span. So the
simulator's peak (profile stash x micro-batches in flight) and the executor's measured peak
agree for the same slice size.

Given the slice's ``rows``, the meter also splits the bytes into the per-sample part and the
whole part (``sample_rows``): a saved tensor is whole when its shape is whole by that rule,
or when it lives in the storage of a whole input (``whole_inputs``: a (1, T, n) rotary
table the layer slices or squeezes before saving). A view of a whole input counts that
input's bytes once, whatever the view's shape, so an ``expand`` to the batch is not taken
for per-sample rows (nor a table sliced from a longer cache for the whole cache). The profile keeps the two parts apart because a slice of any size
stashes one copy of a whole value (``model_profile.stash_span_bytes``).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_dapple.profile.sample_rows import is_whole


class StashMeter:
    """Pack hook for ``torch.autograd.graph.saved_tensors_hooks`` that adds up bytes."""

    def __init__(self, exclude_storages: set[int] | None = None, rows: int = 1, whole_inputs: dict[int, int] | None = None) -> None:
        self.exclude = exclude_storages or set()
        self.rows = rows
        self.whole_inputs = whole_inputs or {}  # storage address -> bytes of the whole input
        self.seen: dict[tuple, tuple[int, bool]] = {}  # view key -> (bytes, whole)
        self.bytes = 0
        self.whole_bytes = 0

    @property
    def per_sample_bytes(self) -> int:
        """Stashed bytes that scale with the slice's rows (``bytes`` less ``whole_bytes``)."""
        return self.bytes - self.whole_bytes

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = storage_address(tensor)
        if storage in self.exclude:
            return tensor
        if storage in self.whole_inputs:
            self._add((storage, -1, (), ()), self.whole_inputs[storage], whole=True)
            return tensor
        self._add(view_key(tensor, storage), tensor.numel() * tensor.element_size(), whole=is_whole(tensor.shape, self.rows))
        return tensor

    def _add(self, key: tuple, size: int, whole: bool) -> None:
        if key not in self.seen:
            self.seen[key] = (size, whole)
            self.bytes += size
            if whole:
                self.whole_bytes += size

    def views_of(self, tensors: "Iterable[torch.Tensor]", whole: bool = False) -> dict[tuple, int]:
        """The saved views that live in the storage of one of ``tensors`` (a layer's inputs
        or outputs), keyed by the tensor's position instead of its address, so that one
        layer's outputs and the next layer's inputs, metered apart, can be matched
        (``shared_views``): the per-sample ones, or with ``whole`` the whole ones (a table
        the layer saves and passes on)."""
        position = {}
        for index, tensor in enumerate(tensors):
            position.setdefault(storage_address(tensor), index)
        return {
            (position[key[0]], *key[1:]): size
            for key, (size, saved_whole) in self.seen.items()
            if saved_whole == whole and key[0] in position and (whole or key[1] >= 0)
        }

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def storage_address(tensor: torch.Tensor) -> int:
    """The address of the storage ``tensor`` lives in (its id where it has none)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def view_key(tensor: torch.Tensor, storage: int) -> tuple:
    """What memory a saved view covers: a contiguous view by its offset and size (so a
    reshape of it is the same memory), any other by its offset, shape and strides."""
    if tensor.layout != torch.strided:
        return (storage, 0, tuple(tensor.shape), ())
    if tensor.is_contiguous():
        return (storage, tensor.storage_offset(), tensor.numel() * tensor.element_size())
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def shared_views(previous_outputs: dict[tuple, int], inputs: dict[tuple, int]) -> int:
    """Bytes a layer saves of its input that the previous layer saves of its output (the
    same views, by position: ``StashMeter.views_of`` of each): stashed once when the two
    layers run on one stage."""
    return sum(size for key, size in inputs.items() if key in previous_outputs)


def whole_input_storages(tensors: "list[torch.Tensor]", exclude: set[int]) -> dict[int, int]:
    """Storage address -> bytes of each of ``tensors`` (the whole inputs of a layer), those
    in ``exclude`` (parameters) left out; for ``StashMeter(whole_inputs=...)``."""
    out: dict[int, int] = {}
    for tensor in tensors:
        storage = next(iter(parameter_storages([tensor])), None)
        if storage is not None and storage not in exclude:
            out[storage] = max(out.get(storage, 0), tensor.numel() * tensor.element_size())
    return out


def parameter_storages(parameters: "list[torch.Tensor] | tuple[torch.Tensor, ...]") -> set[int]:
    """Storage addresses of ``parameters`` (or of any tensors: the whole inputs of a layer)."""
    out = set()
    for param in parameters:
        try:
            out.add(param.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    return out
