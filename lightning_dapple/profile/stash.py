"""One rule for "stashed bytes", shared by the profiler and the executor.

DAPPLE's memory argument (3.2, 5.3) is about the activations each in-flight micro-batch
keeps from its forward until its backward. We measure them with autograd's
saved-tensor hooks: every tensor saved for backward counts with its own bytes (a batch
slice or a view into a receive buffer counts as its rows, not as the whole buffer it
lives in), a tensor saved twice within one layer counts once, parameters not at all.
The profiler applies the rule per layer and the executor per layer of a stage, so the
simulator's peak (profile stash x micro-batches in flight) and the executor's measured
peak agree for the same slice size.

Given the slice's ``rows``, the meter also splits the bytes into the per-sample part and the
whole part (``sample_rows``): a saved tensor is whole when its shape is whole by that rule,
or when it lives in the storage of a whole input (``whole_inputs``: a (1, T, n) rotary
table the layer slices or squeezes before saving). A view of a whole input counts that
input's bytes once, whatever the view's shape, so an ``expand`` to the batch is not taken
for per-sample rows (nor a table sliced from a longer cache for the whole cache). The profile keeps the two parts apart because a slice of any size
stashes one copy of a whole value (``model_profile.stash_span_bytes``).
"""
from __future__ import annotations

import torch

from lightning_dapple.profile.sample_rows import is_whole


class StashMeter:
    """Pack hook for ``torch.autograd.graph.saved_tensors_hooks`` that adds up bytes."""

    def __init__(self, exclude_storages: set[int] | None = None, rows: int = 1, whole_inputs: dict[int, int] | None = None) -> None:
        self.exclude = exclude_storages or set()
        self.rows = rows
        self.whole_inputs = whole_inputs or {}  # storage address -> bytes of the whole input
        self.seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        self.bytes = 0
        self.whole_bytes = 0

    @property
    def per_sample_bytes(self) -> int:
        """Stashed bytes that scale with the slice's rows (``bytes`` less ``whole_bytes``)."""
        return self.bytes - self.whole_bytes

    def next_layer(self) -> None:
        """Start deduplicating afresh: the next layer's saves count on their own."""
        self.seen = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            storage = id(tensor)
        if storage in self.exclude:
            return tensor
        if storage in self.whole_inputs:
            self._add((storage, -1, (), ()), self.whole_inputs[storage], whole=True)
            return tensor
        key = (storage, tensor.storage_offset() if tensor.layout == torch.strided else 0, tuple(tensor.shape), tuple(tensor.stride()) if tensor.layout == torch.strided else ())
        self._add(key, tensor.numel() * tensor.element_size(), whole=is_whole(tensor.shape, self.rows))
        return tensor

    def _add(self, key: tuple[int, int, tuple[int, ...], tuple[int, ...]], size: int, whole: bool) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += size
            if whole:
                self.whole_bytes += size

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


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
