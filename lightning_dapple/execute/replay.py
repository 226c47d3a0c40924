"""Recomputation (gpipe.txt 2.3 re-materialization): replaying a stage forward exactly.

Why not ``torch.utils.checkpoint``: its non-reentrant form recomputes once per autograd
*graph task* and keeps what it recomputed for a task until the saved-tensor holders die.
The executor wants one explicit replay right before a micro-batch's B, under the same
dropout masks, with BatchNorm statistics updated once, and its memory charged at a known
point of the schedule (the planner's memory model, ``schedule.actions.stash_walk``).

Pieces used by the executor's ``Stage`` (``execute/stage.py``), its runner (the RNG) and its
stash sizes (``tensor_bytes``):

* ``discard_saved()``: a forward that records the graph (so each output knows whether it
  requires grad) but keeps none of the tensors saved for backward; used for the F of a
  recomputed micro-batch, which keeps only the stage input, and whose output ``detached``
  cuts from that graph (its backward starts from the replay);
* ``save_rng``/``restore_rng``/``reseed``: a training step saves the caller's RNG state
  once, reseeds before each forward (per micro-batch seeds, so a replay draws the same
  dropout masks) and puts the caller's state back at its end;
* ``buffer_slots(layers)`` / ``scratch_buffers(slots)``: during a replay every buffer of
  the layers (BatchNorm running statistics) is a fresh copy that the replay may update
  and that is dropped afterwards, so the buffers are updated once per micro-batch, by its
  first forward, as without recomputation;
* ``weight_groups(layers)``: the unit of W work -- one layer, or several layers merged
  when they share a parameter (a layer's W then covers all uses of it);
* ``tensor_leaves`` / ``tensor_bytes``: the tensors of a pytree and the byte rule of the
  stash meter.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = [
    "detached",
    "discard_saved",
    "buffer_slots",
    "scratch_buffers",
    "save_rng",
    "restore_rng",
    "step_key",
    "same_rng",
    "reseed",
    "tensor_bytes",
    "tensor_leaves",
    "weight_groups",
]


def _drop(tensor: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:  # pragma: no cover - the graph is never run
    raise RuntimeError("this graph was recorded without saved tensors; recompute the forward before its backward")


def discard_saved() -> contextlib.AbstractContextManager[Any]:
    """Record autograd graphs without keeping any tensor saved for backward."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)


def detached(value: Any) -> Any:
    """``value`` with every tensor detached, keeping which of them require grad."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(cut, value)


def save_rng(device: torch.device) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
    """The CPU (and ``device``'s CUDA) generator state, for ``restore_rng``. A training step
    saves it once and ``reseed``s before each forward, rather than saving and restoring around
    every micro-batch (two tensor copies per forward on the per-micro-batch path)."""
    cuda_state = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda_state = (index, torch.cuda.get_rng_state(index))
    return torch.get_rng_state(), cuda_state


def same_rng(a: tuple[torch.Tensor, tuple[int, torch.Tensor] | None], b: tuple[torch.Tensor, tuple[int, torch.Tensor] | None]) -> bool:
    """Whether two ``save_rng`` states are equal (nothing was drawn between them)."""
    return torch.equal(a[0], b[0]) and (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1][1], b[1][1]))


def restore_rng(state: tuple[torch.Tensor, tuple[int, torch.Tensor] | None]) -> None:
    cpu_state, cuda_state = state
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state[1], cuda_state[0])


def reseed(seed: int, device: torch.device) -> None:
    """Seed the CPU (and ``device``'s CUDA) generator (between ``save_rng`` and ``restore_rng``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    torch.default_generator.manual_seed(seed)


def buffer_slots(layers: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
    """Where the buffers of ``layers`` live: (module, buffer name), each module once (a
    module reached through several layers too). Decided once per stage: a device or dtype
    move replaces the buffer tensors but not where they are registered."""
    slots: list[tuple[nn.Module, str]] = []
    seen: set[int] = set()
    for layer in layers:
        for module in layer.modules():
            if id(module) not in seen:
                seen.add(id(module))
                slots.extend((module, name) for name, _ in module.named_buffers(recurse=False))
    return slots


@contextlib.contextmanager
def scratch_buffers(slots: Sequence[tuple[nn.Module, str]]) -> Iterator[None]:
    """Inside, every buffer in ``slots`` (``buffer_slots``) is a copy of itself; on leaving,
    the originals are back.

    A replayed forward (gpipe.txt 2.3) must not touch the buffers: the first forward of the
    micro-batch already updated BatchNorm's running statistics and ``num_batches_tracked``,
    and updating them again would count the micro-batch twice. Writing the old values back
    afterwards is no way out: ``copy_`` bumps the version of the running statistics, which
    the batch-norm backward of every graph still waiting for its B has saved, so that B
    fails ("modified by an inplace operation"). Here the replay updates copies instead
    (its graph saves those), and the real buffers are never written.

    The tensors are read from their modules when the replay starts, not when the stage
    was built: moving a module to another device or dtype replaces its buffer tensors.
    ``setattr`` swaps them and keeps each buffer's persistence.
    """
    originals = [(module, name, getattr(module, name)) for module, name in slots]
    try:
        for module, name, buffer in originals:
            if buffer is not None:
                setattr(module, name, buffer.detach().clone())
        yield
    finally:
        for module, name, buffer in originals:
            setattr(module, name, buffer)


def weight_groups(layers: Sequence[nn.Module]) -> list[tuple[int, int]]:
    """Half-open stage-local layer ranges of W work: each layer with trainable parameters
    on its own, merged (with everything between) when layers share a parameter."""
    owners: dict[int, list[int]] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            if param.requires_grad:
                owners.setdefault(id(param), []).append(index)
    groups = [[index, index + 1] for index in sorted({i for uses in owners.values() for i in uses})]
    for uses in owners.values():
        lo, hi = min(uses), max(uses) + 1
        if hi - lo > 1:
            merged = [g for g in groups if g[1] <= lo or g[0] >= hi]
            span = [g for g in groups if not (g[1] <= lo or g[0] >= hi)]
            merged.append([min(lo, *(g[0] for g in span)), max(hi, *(g[1] for g in span))])
            groups = sorted(merged)
    return [(a, b) for a, b in groups]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if type(value) is torch.Tensor:  # the common layer output: no tree walk
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def tensor_bytes(value: Any) -> int:
    """Bytes of the distinct tensors in ``value`` (a slice counts as its own rows)."""
    total, seen = 0, set()
    for leaf in tensor_leaves(value):
        key = (leaf.data_ptr(), tuple(leaf.shape), leaf.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += leaf.numel() * leaf.element_size()
    return total


def step_key(job_seed: int | None, steps_done: int, evals_done: int | None = None) -> tuple:
    """What every seed of one step hashes, alike on every rank: the job's seed (None: this
    process's initial seed) and the training steps done; an eval batch adds its count and
    a marker, so its key is never a training step's."""
    base = (job_seed if job_seed is not None else torch.initial_seed(), steps_done)
    return base if evals_done is None else (*base, evals_done, 0)
