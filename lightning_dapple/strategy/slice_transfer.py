"""A stage moves to its device only the rows and fields of the batch that its step reads.

Lightning moves the whole batch to every rank's device before ``training_step``
(``Strategy.batch_to_device``). In a pipeline that is mostly waste: every stage replica
handles its own slice of each micro-batch (DAPPLE 5.2.2), a middle stage reads nothing of
the batch (its input arrives from upstream), the first stage reads only layer 0's input,
and the last only what its loss or output reads (targets, masks). So the dapple strategy
leaves the batch where the DataLoader put it and hands each micro-batch slice, a view of
the batch, to a ``SliceTransfer`` of the step function and role that reads it:

* which leaves: the first time a step function runs in a role (or when the batch's
  structure changes), every tensor leaf of the slice moves, and a ``TorchFunctionMode``
  records which of them the step passed to a torch call that reads data (asking a shape
  or dtype does not; the input the first stage captures counts as read). From then on only those move; the others stay on the host, so
  a step that reads other fields on later batches than on its first sees them there.
* how: ``Tensor.to(device, non_blocking=True)`` on CUDA, which is asynchronous where the
  DataLoader pins its memory (``DataLoader(pin_memory=True)``), and only the slice's rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

__all__ = ["SliceTransfer", "StepTransfers", "to_device"]

T = TypeVar("T")


def to_device(leaf: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One leaf of a slice on ``device`` (the one place a batch's data moves)."""
    return leaf.to(device, non_blocking=device.type == "cuda")


#: what a step may ask of a leaf without reading its data: the same on the host
_METADATA = frozenset(
    {
        torch.Tensor.shape.__get__,
        torch.Tensor.ndim.__get__,
        torch.Tensor.dtype.__get__,
        torch.Tensor.dim,
        torch.Tensor.size,
        torch.Tensor.numel,
        torch.Tensor.__len__,
    }
)


class _ReadLeaves(TorchFunctionMode):
    """Records which of ``leaves`` (by identity) appear among the arguments of torch calls
    that read data (anything but the shape and dtype questions of ``_METADATA``)."""

    def __init__(self, leaves: list[Any]) -> None:
        super().__init__()
        self.index = {id(leaf): position for position, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        self.read: set[int] = set()

    def note(self, values: Any) -> None:
        for value in pytree.tree_leaves(values):
            position = self.index.get(id(value))
            if position is not None:
                self.read.add(position)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            self.note((args, kwargs))
        return func(*args, **kwargs)


class SliceTransfer:
    """Moves what one step function reads in one role (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spec: Any = None
        self._read: frozenset[int] = frozenset()

    @property
    def read(self) -> frozenset[int]:
        """Positions (among the slice's flattened leaves) of the leaves the step reads."""
        return self._read

    def run(self, batch_slice: Any, step: Callable[[Any], T]) -> T:
        """``step(batch_slice)`` with the leaves it reads on the device."""
        leaves, spec = pytree.tree_flatten(batch_slice)
        if spec != self._spec:
            return self._learn(leaves, spec, step)
        moved = [to_device(leaf, self.device) if position in self._read else leaf for position, leaf in enumerate(leaves)]
        return step(pytree.tree_unflatten(moved, spec))

    def _learn(self, leaves: list[Any], spec: Any, step: Callable[[Any], T]) -> T:
        moved = [to_device(leaf, self.device) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        with _ReadLeaves(moved) as reading:
            result = step(pytree.tree_unflatten(moved, spec))
        reading.note(result)  # the first stage's captured input may be a leaf itself
        self._spec, self._read = spec, frozenset(reading.read)
        return result


@dataclass
class StepTransfers:
    """The two roles a step function has in the pipeline: making layer 0's input on the
    first stage, and computing the loss or output on the last."""

    device: torch.device
    first: SliceTransfer = field(init=False)
    last: SliceTransfer = field(init=False)

    def __post_init__(self) -> None:
        self.first = SliceTransfer(self.device)
        self.last = SliceTransfer(self.device)
