"""One rule for "stashed bytes", shared by the profiler and the executor.

DAPPLE's memory argument (3.2, 5.3) is about the activations each in-flight micro-batch
keeps from its forward until its backward. We measure them with autograd's
saved-tensor hooks: every tensor saved for backward counts with its own bytes (a batch
slice or a view into a receive buffer counts as its rows, not as the whole buffer it
lives in), a tensor saved twice within one layer counts once, parameters not at all.
The profiler applies the rule per layer and the executor per layer of a stage, so the
simulator's peak (profile stash x micro-batches in flight) and the executor's measured
peak agree for the same slice size.
"""
from __future__ import annotations

import torch


class StashMeter:
    """Pack hook for ``torch.autograd.graph.saved_tensors_hooks`` that adds up bytes."""

    def __init__(self, exclude_storages: set[int] | None = None) -> None:
        self.exclude = exclude_storages or set()
        self.seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        self.bytes = 0

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
        key = (storage, tensor.storage_offset() if tensor.layout == torch.strided else 0, tuple(tensor.shape), tuple(tensor.stride()) if tensor.layout == torch.strided else ())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def parameter_storages(parameters: "list[torch.Tensor] | tuple[torch.Tensor, ...]") -> set[int]:
    out = set()
    for param in parameters:
        try:
            out.add(param.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    return out
