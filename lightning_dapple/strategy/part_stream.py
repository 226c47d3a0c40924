"""How the parts of a consolidated checkpoint reach rank 0: in host memory, one sender at a time.

A consolidated checkpoint (``checkpoint.py``) is assembled on rank 0 from one part per
stage: the stage leader's state-dict entries and optimizer state (the replicas of a stage
hold the same weights after DAPPLE's synchronous update, 5.2.3, so one of them speaks).
PipeDream (sec. 4, "Checkpointing") writes one file per stage instead; a single file is
what lets the plain module load it and another plan resume from it. Handing the parts to a
collective as they are costs two things on a GPU cluster: a pickled CUDA tensor is rebuilt
on rank 0 on the *sender's* device index (allocating on another rank's GPU, or failing where
that index does not exist: other nodes, per-rank ``CUDA_VISIBLE_DEVICES``), and
``gather_object`` under NCCL stages world size x the largest payload on rank 0's GPU. Here:

* every tensor moves to the CPU on its sender, one tensor at a time, just before it is sent,
  so a GPU rank never holds more than one extra tensor in host memory;
* parts travel over gloo, so nothing touches a GPU on rank 0: the default group when it is
  gloo, else a gloo group opened once for checkpoints (``open_part_lane``);
* rank 0 takes the senders in turn. A part arrives as a small pickled header (its structure,
  each dense tensor replaced by its shape and dtype), then each tensor straight into the CPU
  tensor rank 0 keeps. A gloo send waits until the receiver has posted the matching receive
  (unbound buffers: the sender transmits on the receiver's "ready"), so a sender's bytes
  reach rank 0 only when rank 0 asks for them. Rank 0 holds the consolidated state plus one
  header at any time, never world size x a payload, and no staging copy of a part.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

PART_TAG = 11  # the schedule's transfers use tag 0 and results 7: a checkpoint part matches neither


def _wait_plainly(work: Any, what: str) -> None:
    work.wait()


@dataclass(frozen=True)
class PartLane:
    """The path parts take to rank 0: a process group that carries CPU tensors (None: the
    default group) and the bounded wait every transfer goes through (``FailureChannel.wait``
    in the strategy, so a peer's failure ends the save on every rank)."""

    group: Any = None
    wait: Callable[[Any, str], None] = _wait_plainly

    def send(self, tensor: torch.Tensor, destination: int, what: str) -> None:
        self.wait(dist.isend(tensor, destination, group=self.group, tag=PART_TAG), what)

    def receive(self, tensor: torch.Tensor, source: int, what: str) -> None:
        self.wait(dist.irecv(tensor, source, group=self.group, tag=PART_TAG), what)


def open_part_lane(wait: Callable[[Any, str], None], timeout: timedelta) -> PartLane:
    """A lane over the default group where it carries CPU tensors (gloo, also behind the
    staged wire), else over a new gloo group of all ranks with ``timeout``. Opening the
    group is a collective: every rank calls this at the same point (the first save)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or _carries_cpu(dist.get_backend()):
        return PartLane(None, wait)
    return PartLane(dist.new_group(backend="gloo", timeout=timeout), wait)


def _carries_cpu(backend: str) -> bool:
    """gloo, alone or as the CPU half of a mixed backend ("cpu:gloo,cuda:nccl")."""
    return str(backend).lower() == "gloo" or "cpu:gloo" in str(backend).lower()


def to_host(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (CPU tensors are not copied)."""
    return pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


@dataclass(frozen=True)
class _TensorSlot:
    """Where a part's header holds the place of a tensor that follows it on the wire."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _is_dense(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested


def _split(part: Any) -> tuple[Any, list[torch.Tensor]]:
    """The part's header (its structure with a ``_TensorSlot`` for each distinct dense
    tensor; other tensors, rare, moved to the CPU in place) and those tensors, in slot
    order, where they live now. The same memory reached twice (a module's layers under two
    names: ``state_dict`` gives each name its own detached view) is sent once and arrives
    shared, so the file stores it once, as ``torch.save`` does for shared storage."""
    leaves, spec = pytree.tree_flatten(part)
    tensors: list[torch.Tensor] = []
    slots: dict[tuple, _TensorSlot] = {}
    header_leaves: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and _is_dense(leaf):
            view = _view_of(leaf)
            if view not in slots:
                slots[view] = _TensorSlot(len(tensors), tuple(leaf.shape), leaf.dtype)
                tensors.append(leaf)
            header_leaves.append(slots[view])
        else:
            header_leaves.append(to_host(leaf))
    return pytree.tree_unflatten(header_leaves, spec), tensors


def _view_of(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same data: their memory and how they read it."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (gloo moves bytes; every dtype, bool
    and complex included, travels this way)."""
    return tensor.reshape(-1).view(torch.uint8)


def send_part(part: Any, lane: PartLane) -> None:
    """Send ``part`` to rank 0: its header, then each tensor, moved to the CPU just before
    it goes (each send returns once rank 0 has taken it, so one host copy lives at a time)."""
    header, tensors = _split(part)
    blob = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
    lane.send(torch.tensor([blob.numel()], dtype=torch.int64), 0, "rank 0 to take a checkpoint part's header")
    lane.send(blob, 0, "rank 0 to take a checkpoint part's header")
    for tensor in tensors:
        host = tensor.detach().cpu().contiguous()
        if host.numel():
            lane.send(_as_bytes(host), 0, "rank 0 to take a checkpoint tensor")


def receive_part(source: int, lane: PartLane) -> Any:
    """Rank 0: the part ``source`` sends, every tensor received into the CPU tensor returned."""
    size = torch.zeros(1, dtype=torch.int64)
    lane.receive(size, source, f"the checkpoint part of rank {source}")
    blob = torch.empty(int(size.item()), dtype=torch.uint8)
    lane.receive(blob, source, f"the checkpoint part of rank {source}")
    header = pickle.loads(blob.numpy().tobytes())
    del blob
    slots = {leaf.index: leaf for leaf in pytree.tree_leaves(header) if isinstance(leaf, _TensorSlot)}
    received = [_receive_tensor(slots[index], source, lane) for index in range(len(slots))]
    return pytree.tree_map(lambda leaf: received[leaf.index] if isinstance(leaf, _TensorSlot) else leaf, header)


def _receive_tensor(slot: _TensorSlot, source: int, lane: PartLane) -> torch.Tensor:
    tensor = torch.empty(slot.shape, dtype=slot.dtype)
    if tensor.numel():
        lane.receive(_as_bytes(tensor), source, f"a checkpoint tensor of rank {source}")
    return tensor
