"""Consolidated, plan-independent checkpoints for pipelined training.

Every rank holds one stage's layers, but a checkpoint must be loadable by the plain
LightningModule (no dapple) and resumable under a different plan (other stage or device
counts). So the state dict is gathered to rank 0 with the module's original keys, and
the optimizer state is keyed by parameter *name* instead of by position; on resume each
rank picks the entries of the parameters it owns under the new plan. A tensor the module
reaches by several keys (tied weights, a second path to a layer) is held once: one stage
contributes it under its canonical key, and every other key of it names the same tensor in
the file, as in a plain module's own state dict. The parts reach rank 0 on the CPU, one
stage leader after another (``part_stream.py``), so a save needs no GPU memory on rank 0,
and no host memory there beyond the checkpoint and one part's header. Files are written
to a temporary name in the target directory, flushed, and renamed, so a crash leaves the
previous checkpoint intact. ``checkpoint="sharded"`` (``sharded_checkpoint.py``) writes
the same entries, keyed the same way, from each stage leader into a directory instead, and
reads them back through ``load_local_optimizer_states`` too.

Rank 0 takes the parts in turn, so a leader's part waits for rank 0 to take every earlier
leader's part first: with tens of GB that is far longer than ``timeout_s``, which bounds
one transfer. So a leader does not offer its part until its turn has come
(``PartTurns``): rank 0 says in the job's store which leader it takes next, and counts
its progress there while it takes a part. The leader's wait for its turn ends with an
error only when rank 0 has made no progress for ``timeout_s`` (or failed, or stopped
beating: the failure channel's rules); each transfer of the part is then bounded by
``timeout_s`` as before.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn
from typing_extensions import override

from lightning_dapple.atomic_files import atomic_write, remove_stale_temporaries
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import LONG_WAIT_S, CommTimeoutError, FailureChannel
from lightning_dapple.strategy.part_stream import PartLane, receive_part, send_part, to_host

NAMED_MARKER = "dapple_keyed_by_name"


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a rank's part of the whole module's state lives, fixed once the plan is set.

    ``key_owner``: each state-dict key of the whole module -> the layer owning it (None:
    outside the layer list, kept by rank 0); ``parameter_names``: the whole module's
    parameter names in ``named_parameters`` order (what a plain run's optimizer indexes);
    ``stage_leaders``: each stage's first replica, the rank that contributes the stage's
    entries (replicas hold the same state after the synchronous update, DAPPLE 5.2.3);
    ``aliases``: each key whose tensor another key (its canonical key) also names -> that
    key (tied weights, handles); ``layers``: the layer ranges of this rank's stages (one,
    or a device group's chunks; a tied parameter's optimizer state comes from the stage of
    its first layer only); ``optimizer_ranks``: the ranks holding optimizer state to save,
    where not only the stage leaders (under ZeRO-1 every replica keeps its own share,
    ``zero.py``).
    """

    key_owner: dict[str, int | None]
    parameter_names: list[str]
    stage_leaders: tuple[int, ...]
    global_rank: int
    aliases: dict[str, str] = field(default_factory=dict)
    layers: tuple[tuple[int, int], ...] | None = None
    optimizer_ranks: tuple[int, ...] = ()

    def canonical(self, key: str) -> str:
        """The key a tensor is held under (``key`` itself unless it is an alias)."""
        return self.aliases.get(key, key)

    def owns_parameter(self, name: str) -> bool:
        """Whether this rank's stage contributes the optimizer state of parameter ``name``:
        the stage holding the first layer that uses it."""
        owner = self.key_owner.get(self.canonical(name))
        return self.layers is None or owner is None or any(start <= owner < end for start, end in self.layers)

    @property
    def stage_leader(self) -> bool:
        return self.global_rank in self.stage_leaders

    def contributes(self, key: str) -> bool:
        """Whether this rank's state-dict entry ``key`` goes into the checkpoint: rank 0
        keeps the entries outside the layers, a stage leader its layers' entries; an
        alias never (its tensor travels once, under its canonical key)."""
        if key in self.aliases:
            return False
        if self.key_owner.get(key) is None:
            return self.global_rank == 0
        return self.stage_leader

    @property
    def optimizer_contributor(self) -> bool:
        """Whether this rank holds optimizer state that a checkpoint saves."""
        return self.global_rank in (self.optimizer_ranks or self.stage_leaders)

    @property
    def optimizer_senders(self) -> list[int]:
        """The ranks whose optimizer parts rank 0 receives, in the order it takes them."""
        return sorted(set(self.optimizer_ranks or self.stage_leaders) - {0})

    @property
    def senders(self) -> list[int]:
        """The ranks whose parts rank 0 receives, in the order it takes them."""
        return sorted(set(self.stage_leaders) - {0})


TURN_KEY = "lightning_dapple/checkpoint/turn/{rank}"  # parts rank 0 has begun to take from a rank
OFFERED_KEY = "lightning_dapple/checkpoint/offered/{rank}"  # parts a rank has had to send
PROGRESS_KEY = "lightning_dapple/checkpoint/progress"  # rank 0's progress through the parts
PROGRESS_EVERY_S = 0.5  # rank 0 counts its progress at most this often (one store call)


class PartTurns:
    """The lane's wait (the failure channel's) and the order of the parts (module docstring).

    Given to ``open_part_lane`` as the lane's ``wait``, so every lane made from it (the
    sharded writers' too) carries it. A sender calls ``await_turn`` before it sends a part;
    rank 0 calls ``begin`` before it takes a sender's part and takes the part through
    ``counting(lane)``, which counts its progress in the store as tensors arrive.
    """

    def __init__(self, failure: FailureChannel, poll_s: float = 0.05) -> None:
        self.failure = failure
        self.poll_s = poll_s
        self._counted_at = 0.0

    def __call__(self, work: Any, what: str) -> None:
        self.failure.wait(work, what)

    @property
    def _store(self) -> Any:
        return self.failure.store

    def begin(self, source: int) -> None:
        """Rank 0: it takes ``source``'s next part now."""
        self._store.add(TURN_KEY.format(rank=source), 1)
        self._count(force=True)

    def counting(self, lane: PartLane) -> PartLane:
        """``lane`` whose every completed transfer counts as rank 0's progress."""

        def wait(work: Any, what: str) -> None:
            self(work, what)
            self._count()

        return PartLane(lane.group, wait)

    def _count(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._counted_at >= PROGRESS_EVERY_S:
            self._counted_at = now
            self._store.add(PROGRESS_KEY, 1)

    def await_turn(self, rank: int) -> None:
        """A sender: wait until rank 0 takes this rank's part, for as long as rank 0 makes
        progress on the earlier parts; ``CommTimeoutError`` after ``timeout_s`` without any."""
        store, limit = self._store, self.failure.timeout_s
        wanted = int(store.add(OFFERED_KEY.format(rank=rank), 1))
        seen = [int(store.add(PROGRESS_KEY, 0)), time.monotonic()]

        def ready() -> bool:
            if int(store.add(TURN_KEY.format(rank=rank), 0)) >= wanted:
                return True
            progress, now = int(store.add(PROGRESS_KEY, 0)), time.monotonic()
            if progress != seen[0]:
                seen[:] = [progress, now]
            elif now - seen[1] > limit:
                raise CommTimeoutError(
                    f"rank {rank}: rank 0 took no checkpoint part for {limit:.0f} s while this rank waited to send its own; "
                    "rank 0 may be stuck. Raise DappleStrategy(timeout_s=...) if one checkpoint tensor takes this long"
                )
            return False

        self.failure.wait_until(ready, "rank 0 to take this rank's checkpoint part", limit_s=LONG_WAIT_S)


def _turns(lane: PartLane) -> PartTurns | None:
    return lane.wait if isinstance(lane.wait, PartTurns) else None


def _send_in_turn(part: Any, lane: PartLane, rank: int) -> None:
    """A sender's part, once its turn has come (at once where the lane keeps no turns)."""
    turns = _turns(lane)
    if turns is not None:
        turns.await_turn(rank)
    send_part(part, lane)


def _receive_in_turn(sources: list[int], lane: PartLane) -> Iterator[Any]:
    """Rank 0: each source's part, in order, each source told when its turn comes."""
    turns = _turns(lane)
    taking = turns.counting(lane) if turns is not None else lane
    for source in sources:
        if turns is not None:
            turns.begin(source)
        yield receive_part(source, taking)


def consolidated_state_dict(module: nn.Module, layout: CheckpointLayout, lane: PartLane | None = None) -> dict[str, Any]:
    """The whole module's state dict on rank 0, on the CPU (original keys and order); {}
    elsewhere. Rank 0 contributes the entries outside the layers and, as a stage leader,
    its stage's; the other leaders stream theirs to it (``part_stream.py``), each in its
    turn (``PartTurns``)."""
    lane = lane if lane is not None else PartLane()
    mine = {key: value for key, value in module.state_dict().items() if layout.contributes(key)}
    if layout.global_rank != 0:
        if layout.stage_leader:
            _send_in_turn(mine, lane, layout.global_rank)
        return {}
    merged: dict[str, Any] = to_host(mine)
    for part in _receive_in_turn(layout.senders, lane):
        merged.update(part)
    for alias, key in layout.aliases.items():  # one tensor, every name of it
        if key in merged:
            merged[alias] = merged[key]
    missing = [key for key in layout.key_owner if key not in merged]
    if missing:
        raise RuntimeError(f"checkpoint consolidation lost keys {missing[:3]}")
    return {key: merged[key] for key in layout.key_owner}


def names_by_param(module: nn.Module, layout: CheckpointLayout | None) -> dict[int, str]:
    """Each local parameter's canonical name (a tied copy answers to its first name)."""
    return {id(p): layout.canonical(name) if layout is not None else name for name, p in module.named_parameters()}


def named_optimizer_state(module: nn.Module, layout: CheckpointLayout, optimizer: Any) -> dict[str, Any]:
    """This rank's stage's part of ``optimizer``'s state, keyed by parameter name: the
    entries of the parameters it owns (``CheckpointLayout.owns_parameter``) and its
    parameter groups with the names of those parameters."""
    names = names_by_param(module, layout)
    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index_to_name = {index: names[id(p)] for index, p in enumerate(params)}
    mine = {index for index, name in index_to_name.items() if layout.owns_parameter(name)}
    return {
        "state": {index_to_name[index]: value for index, value in state_dict["state"].items() if index in mine},
        "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [index_to_name[i] for i in group["params"] if i in mine]}
            for group in state_dict["param_groups"]
        ],
    }


def consolidated_optimizer_state(
    module: nn.Module, layout: CheckpointLayout, optimizer: Any, lane: PartLane | None = None
) -> dict[str, Any]:
    """Optimizer state of all stages keyed by parameter name, on rank 0 and on the CPU; {}
    elsewhere. Each stage leader contributes its stage's, rank 0 first, then the others
    streamed in rank order (``part_stream.py``)."""
    lane = lane if lane is not None else PartLane()
    named = named_optimizer_state(module, layout, optimizer) if layout.optimizer_contributor else None
    if layout.global_rank != 0:
        if named is not None:
            _send_in_turn(named, lane, layout.global_rank)
        return {}
    merged: dict[str, Any] = {"state": {}, "param_groups": [], NAMED_MARKER: True}
    if named is not None:
        merge_optimizer_part(merged, to_host(named))
    for part in _receive_in_turn(layout.optimizer_senders, lane):
        merge_optimizer_part(merged, part)
    return merged


def merge_optimizer_part(merged: dict[str, Any], part: dict[str, Any]) -> None:
    """Add one stage's named optimizer state: its entries, and its parameters' names to the
    parameter groups of the same position."""
    merged["state"].update(part["state"])
    for index, group in enumerate(part["param_groups"]):
        if index == len(merged["param_groups"]):
            merged["param_groups"].append({**group, "params": list(group["params"])})
        else:
            merged["param_groups"][index]["params"].extend(group["params"])


def load_local_state_dict(module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
    """Load the entries of a consolidated state dict that this rank's module holds."""
    wanted = module.state_dict()
    local = {key: value for key, value in state_dict.items() if key in wanted}
    missing = [key for key in wanted if key not in local]
    if strict and missing:
        raise DappleConfigError(
            "checkpoint state_dict", f"lacks {missing[:3]}", "resume from a checkpoint of the same model"
        )
    module.load_state_dict(local, strict=False)


def load_local_optimizer_states(module: nn.Module, layout: CheckpointLayout, optimizers: list[Any], states: list[dict[str, Any]]) -> None:
    """Give each local optimizer the saved state of the parameters it now holds."""
    names = names_by_param(module, layout)
    for optimizer, saved in zip(optimizers, states):
        if not saved.get(NAMED_MARKER):
            saved = _index_keyed_to_named(layout, saved)
        by_name = saved["state"]
        local_groups = []
        local_state: dict[int, Any] = {}
        index = 0
        for group_number, group in enumerate(optimizer.param_groups):
            saved_group = saved["param_groups"][min(group_number, len(saved["param_groups"]) - 1)]
            indices = []
            for param in group["params"]:
                name = names[id(param)]
                if name in by_name:
                    local_state[index] = by_name[name]
                indices.append(index)
                index += 1
            local_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
        optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})


def _index_keyed_to_named(layout: CheckpointLayout, saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of plain (non-dapple) training: positions follow the full module's
    parameter order, as ``optimizer(self.parameters())`` builds it."""
    order = layout.parameter_names
    positions = [i for group in saved["param_groups"] for i in group["params"]]
    if len(positions) != len(order):
        raise DappleConfigError(
            "checkpoint optimizer_states",
            "were saved by plain training with parameter groups that cannot be mapped to names",
            "resume from a checkpoint written by the dapple strategy, or use one optimizer over self.parameters()",
        )
    name_of = {position: order[n] for n, position in enumerate(positions)}
    return {
        "state": {name_of[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
        NAMED_MARKER: True,
    }


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` through the package's atomic writer (``atomic_files.py``): a temporary
    file beside the target, fsync, then a rename over it.

    A process killed at any point of the write leaves the target as it was (the previous
    checkpoint, complete) plus at most a hidden ``.<name>.<random>.tmp`` file, which is not
    a ``.ckpt`` file, so ``ckpt_path="last"`` never picks it; the next save of the same
    target removes it. The file gets the mode a plain ``open()`` would give it.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        fs = get_filesystem(path)
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        if "file" not in protocols and "local" not in protocols:
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        atomic_write(target, lambda stream: torch.save(checkpoint, stream))
