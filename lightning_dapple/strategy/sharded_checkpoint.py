"""Sharded checkpoints: every stage leader writes its own stage; no rank gathers the model.

``DappleStrategy(checkpoint="sharded")`` writes a checkpoint as a directory, laid out as
Lightning's FSDP and ModelParallel strategies lay theirs out:

* ``.metadata`` and ``__<n>_0.distcp``: ``torch.distributed.checkpoint`` (DCP) files, one
  ``.distcp`` file per writer. The writers are the stage leaders (each stage's first
  replica) and rank 0: the replicas of a stage hold the same weights and optimizer state
  after DAPPLE's synchronous update (5.2.3), so the others contribute nothing. Rank 0 also
  writes the entries outside the layers, as it does in a consolidated file.
* ``meta.pt``: the rest of Lightning's checkpoint dict (loops, epoch, global step,
  callbacks, LR schedulers, hyper-parameters, ...), written by rank 0 with ``torch.save``,
  and under ``"dapple_sharded"`` what rebuilding a consolidated file needs: the module's
  state-dict keys in order, the keys that name another key's tensor (ties, handles), the
  number of optimizers.

The DCP entries are flat and keyed as a consolidated file keys them, so another plan finds
its tensors by name: ``state_dict/<state-dict key>`` (canonical keys only: a tied tensor is
stored once), ``optimizer_states/<i>/state/<parameter name>/<field>`` (Adam's ``exp_avg``,
``step``, ...) and ``optimizer_states/<i>/groups/<writer rank>`` (each writer's parameter
groups: hyper-parameters and its parameters' names). On resume every rank asks DCP for
exactly the entries of the parameters it now holds (``dcp.load`` without collectives,
into the module's own tensors), whatever plan wrote them; the optimizer state goes through
``checkpoint.load_local_optimizer_states``, as a consolidated file's does.

A save is atomic: rank 0 makes a hidden ``.<name>.<random>.tmp`` directory beside the
target, every writer's DCP files and ``meta.pt`` go there, and rank 0 then swaps it in
(``renameat2(RENAME_EXCHANGE)`` where the file system has it, else two renames). A crash
before the swap leaves the previous checkpoint and a temporary directory that the next
save of that target removes.

``consolidate`` turns such a directory into the consolidated file of today (loadable by
the plain module, resumable with any plan), and ``shard`` turns a consolidated file into a
directory; ``python -m lightning_dapple.strategy.sharded_checkpoint consolidate DIR FILE``
(or ``shard FILE DIR``) runs them from a shell.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

from lightning_dapple.atomic_files import file_mode, fsync_directory
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import checkpoint as ckpt
from lightning_dapple.strategy.part_stream import PartLane, to_host

META_FILE = _METADATA_FILENAME  # "meta.pt", as Lightning's FSDP/ModelParallel checkpoints name it
FORMAT_KEY = "dapple_sharded"
MODEL = "state_dict/"
OPTIMIZERS = "optimizer_states/"
WRITE_WAIT_S = 1800.0  # a writer waits this long (or timeout_s, if longer) for the slowest writer
MODES = ("consolidated", "sharded")


@contextmanager
def _single_process(no_dist: bool) -> Iterator[None]:
    """DCP's warning that it works in one process, where that is meant."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def is_sharded(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (DCP metadata and ``meta.pt``)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / ".metadata").is_file()


def writers(layout: ckpt.CheckpointLayout) -> list[int]:
    """The ranks that write: rank 0 (the entries outside the layers), every stage leader,
    and under ZeRO-1 every replica holding a share of the optimizer state."""
    return sorted(set(layout.stage_leaders) | set(layout.optimizer_ranks) | {0})


@dataclass(frozen=True)
class WriterLane(PartLane):
    """The consolidated parts' lane plus the gloo group of the writers (None: one writer,
    which saves without collectives). Held where the strategy holds its part lane, so
    releasing that lane at exit releases this group too."""

    writer_group: Any = None


def open_writer_lane(lane: PartLane, layout: ckpt.CheckpointLayout, timeout_s: float) -> WriterLane:
    """``lane`` with the writers' group. Opening a group is a collective: every rank calls
    this at the same point (the first sharded save)."""
    group = None
    ranks = writers(layout)
    if dist.is_initialized() and len(ranks) > 1:
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=max(timeout_s, WRITE_WAIT_S)))
    return WriterLane(lane.group, lane.wait, group)


# -- saving ----------------------------------------------------------------------------
def local_state_dict(module: nn.Module, layout: ckpt.CheckpointLayout) -> dict[str, Any]:
    """This rank's contribution to the model's entries: its stage's (a stage leader), the
    entries outside the layers (rank 0); {} on other replicas. Nothing is gathered."""
    return {key: value for key, value in module.state_dict().items() if layout.contributes(key)}


def local_optimizer_state(module: nn.Module, layout: ckpt.CheckpointLayout, optimizer: Any) -> dict[str, Any]:
    """This stage's optimizer state keyed by parameter name (stage leaders); {} elsewhere."""
    return ckpt.named_optimizer_state(module, layout, optimizer) if layout.optimizer_contributor else {}


def _flat_entries(state: dict[str, Any], optimizer_states: Sequence[dict[str, Any]] | None, rank: int) -> dict[str, Any]:
    """One writer's DCP entries (see the module docstring for the keys)."""
    flat: dict[str, Any] = {MODEL + key: value for key, value in state.items()}
    for index, named in enumerate(optimizer_states or []):
        if not named:
            continue
        for name, fields in named["state"].items():
            for field_name, value in fields.items():
                flat[f"{OPTIMIZERS}{index}/state/{name}/{field_name}"] = value
        flat[f"{OPTIMIZERS}{index}/groups/{rank:06d}"] = named["param_groups"]
    return flat


def _format_record(keys: Sequence[str], aliases: dict[str, str], optimizer_states: Any, writer_ranks: Sequence[int]) -> dict[str, Any]:
    return {
        "version": 1,
        "keys": list(keys),
        "aliases": dict(aliases),
        "optimizers": None if optimizer_states is None else len(optimizer_states),
        "writers": list(writer_ranks),
    }


def prepare_target(filepath: Any) -> tuple[str, str]:
    """Rank 0, before a save: the target's path and a fresh temporary directory beside it
    (what an earlier save killed mid-write left there is removed first)."""
    target = Path(filepath)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target)
    staging = tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.chmod(staging, _directory_mode())
    return str(target), staging


def save_part(checkpoint: dict[str, Any], staging: str, layout: ckpt.CheckpointLayout, lane: WriterLane | None) -> None:
    """Every rank: a writer stores its entries in ``staging`` (a collective of the writers:
    it returns once all of them and DCP's ``.metadata`` are written), rank 0 then
    ``meta.pt``. Other replicas return at once."""
    rank = layout.global_rank
    if rank not in writers(layout):
        return
    optimizer_states = checkpoint.get("optimizer_states")
    flat = _flat_entries(checkpoint.get("state_dict", {}), optimizer_states, rank)
    _write_entries(flat, staging, lane.writer_group if lane is not None else None)
    if rank == 0:
        meta = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        meta[FORMAT_KEY] = _format_record(layout.key_owner, layout.aliases, optimizer_states, writers(layout))
        _write_meta(to_host(meta), Path(staging))


def _write_entries(flat: dict[str, Any], staging: str, group: Any) -> None:
    """Store the entries with DCP: one file per writer, the writers' ``.metadata`` by the
    first (a collective of ``group``; None: this process alone)."""
    with _single_process(group is None):
        dcp.save(
            flat,
            storage_writer=dcp.FileSystemWriter(staging, single_file_per_rank=True, sync_files=True),
            planner=dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
            no_dist=group is None,
        )


def _write_meta(meta: dict[str, Any], directory: Path) -> None:
    with open(directory / META_FILE, "wb") as stream:
        torch.save(meta, stream)
        stream.flush()
        os.fsync(stream.fileno())


def publish(staging: str, target: str) -> None:
    """Rank 0, after every writer finished: put the complete directory in the target's
    place in one step where the file system allows it (the previous checkpoint stays whole
    until then), and remove the previous one."""
    staged, final = Path(staging), Path(target)
    fsync_directory(staged)
    if not final.exists() and not final.is_symlink():
        os.replace(staged, final)
    elif _exchange(staged, final):  # atomic: the previous checkpoint is now at ``staged``
        _remove(staged)
    else:  # two renames: a crash between them leaves the previous checkpoint as ``.old``
        old = staged.with_name(staged.name[: -len(".tmp")] + ".old")
        os.replace(final, old)
        os.replace(staged, final)
        _remove(old)
    fsync_directory(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the C
    library or the file system lacks it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_stale(target: Path) -> None:
    """Temporary directories (or files) of ``target`` left by a killed save; a previous
    checkpoint a crash left as ``.old`` between two renames goes back to its name."""
    for old in target.parent.glob(f".{target.name}.*.old"):
        if not target.exists():
            os.replace(old, target)
        else:
            _remove(old)
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        _remove(stale)


def _directory_mode() -> int:
    """The mode ``mkdir`` would give (0755 under the usual umask), not ``mkdtemp``'s 0700."""
    mode = file_mode()
    return mode | ((mode & 0o444) >> 2)


# -- loading ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardedSource:
    """Stands in Lightning's loaded checkpoint for what stays in the DCP files: the model's
    entries (``optimizer`` None) or optimizer ``optimizer``'s state. The strategy's
    ``load_model_state_dict`` / ``load_optimizer_state_dict`` read them."""

    path: str
    optimizer: int | None = None


def load_meta(path: Any, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict of a sharded checkpoint, tensors of the model and the
    optimizers left in the files (``ShardedSource`` in their place)."""
    meta = pl_load(Path(path) / META_FILE, map_location="cpu", weights_only=weights_only)
    record = meta[FORMAT_KEY]
    meta["state_dict"] = ShardedSource(str(path))
    if record["optimizers"] is not None:
        meta["optimizer_states"] = [ShardedSource(str(path), index) for index in range(record["optimizers"])]
    return meta


def _entries(path: str) -> dict[str, Any]:
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _read(path: str, request: dict[str, Any]) -> dict[str, Any]:
    """Fill ``request`` (entry -> a tensor to load into, or None for a non-tensor) from the
    files, on this rank alone (no collective)."""
    if request:
        with _single_process(True):
            dcp.load(
                request,
                storage_reader=dcp.FileSystemReader(path),
                planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    return request


def _empty_like_entry(entry: Any) -> Any:
    """A CPU tensor to load an entry into (None: a pickled object)."""
    if isinstance(entry, dcp.metadata.TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype)
    return None


def load_local_model(module: nn.Module, layout: ckpt.CheckpointLayout | None, source: ShardedSource, strict: bool = True) -> None:
    """Load into this rank's module exactly the entries it holds, straight into its tensors
    (an alias of a tied tensor reads its canonical entry)."""
    stored = _entries(source.path)
    local = module.state_dict()
    where: dict[str, str] = {}
    for key in local:
        canonical = MODEL + (layout.canonical(key) if layout is not None else key)
        where[key] = canonical if canonical in stored else MODEL + key
    missing = [key for key, entry in where.items() if entry not in stored]
    if strict and missing:
        raise DappleConfigError("checkpoint state_dict", f"lacks {missing[:3]}", "resume from a checkpoint of the same model")
    request = {entry: local[key].detach() if isinstance(local[key], torch.Tensor) else None for key, entry in where.items() if entry in stored}
    _read(source.path, request)
    module.load_state_dict({key: request[entry] for key, entry in where.items() if entry in request}, strict=False)


def _named_state(path: str, index: int, stored: dict[str, Any], wanted: set[str] | None) -> dict[str, Any]:
    """Optimizer ``index``'s state keyed by name, for the parameters in ``wanted`` (None:
    all), with every writer's parameter groups merged in rank order."""
    prefix = f"{OPTIMIZERS}{index}/"
    request: dict[str, Any] = {}
    for entry, info in stored.items():
        if not entry.startswith(prefix):
            continue
        rest = entry[len(prefix):]
        if rest.startswith("groups/"):
            request[entry] = None
        elif wanted is None or rest[len("state/"):].rpartition("/")[0] in wanted:
            request[entry] = _empty_like_entry(info)
    _read(path, request)
    named: dict[str, Any] = {"state": {}, "param_groups": [], ckpt.NAMED_MARKER: True}
    for entry in sorted(e for e in request if e[len(prefix):].startswith("groups/")):
        ckpt.merge_optimizer_part(named, {"state": {}, "param_groups": request[entry]})
    for entry, value in request.items():
        rest = entry[len(prefix):]
        if rest.startswith("state/"):
            name, _, field_name = rest[len("state/"):].rpartition("/")
            named["state"].setdefault(name, {})[field_name] = value
    return named


def load_local_optimizers(module: nn.Module, layout: ckpt.CheckpointLayout, optimizers: Sequence[Any], sources: Sequence[ShardedSource]) -> None:
    """Give each local optimizer the saved state of the parameters it now holds, read by
    parameter name from the files (nothing of other stages is read)."""
    stored = _entries(sources[0].path) if sources else {}
    names = ckpt.names_by_param(module, layout)
    states = []
    for optimizer, source in zip(optimizers, sources):
        wanted = {names[id(p)] for group in optimizer.param_groups for p in group["params"]}
        states.append(_named_state(source.path, int(source.optimizer or 0), stored, wanted))
    ckpt.load_local_optimizer_states(module, layout, list(optimizers), states)


# -- converting ------------------------------------------------------------------------
def consolidate(directory: Any, file: Any) -> None:
    """Write the consolidated checkpoint file of a sharded checkpoint directory: the
    module's original keys in order (a tied tensor under each of its keys), optimizer state
    keyed by name, the rest of Lightning's dict. Holds the whole checkpoint in memory."""
    path = str(directory)
    meta = pl_load(Path(path) / META_FILE, map_location="cpu", weights_only=False)
    record = meta.pop(FORMAT_KEY)
    stored = _entries(path)
    model = _read(path, {entry: _empty_like_entry(info) for entry, info in stored.items() if entry.startswith(MODEL)})
    aliases = record["aliases"]
    checkpoint = {**meta, "state_dict": {key: model[MODEL + aliases.get(key, key)] for key in record["keys"]}}
    if record["optimizers"] is not None:
        checkpoint["optimizer_states"] = [_named_state(path, index, stored, None) for index in range(record["optimizers"])]
    ckpt.AtomicCheckpointIO().save_checkpoint(checkpoint, file)


def shard(file: Any, directory: Any) -> None:
    """Write a consolidated checkpoint file (one the strategy wrote: optimizer state keyed
    by name) as a sharded directory with one writer."""
    checkpoint = pl_load(str(file), map_location="cpu", weights_only=False)
    state = checkpoint.pop("state_dict")
    optimizer_states = checkpoint.pop("optimizer_states", None)
    for saved in optimizer_states or []:
        if not saved.get(ckpt.NAMED_MARKER):
            raise DappleConfigError(
                "shard()", f"got {file}, whose optimizer state is keyed by position (plain Lightning)",
                "resume it with strategy='dapple' once and save again, or shard a checkpoint the strategy wrote",
            )
    aliases = _aliases(state)
    target, staging = prepare_target(directory)
    flat = _flat_entries({k: v for k, v in state.items() if k not in aliases}, optimizer_states, 0)
    _write_entries(flat, staging, None)
    checkpoint[FORMAT_KEY] = _format_record(list(state), aliases, optimizer_states, [0])
    _write_meta(checkpoint, Path(staging))
    publish(staging, target)


def _aliases(state: dict[str, Any]) -> dict[str, str]:
    """Keys whose tensor an earlier key holds too (ties, a second path to a layer)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        view = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if view in first and value.numel():
            aliases[key] = first[view]
        else:
            first.setdefault(view, key)
    return aliases


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_dapple.strategy.sharded_checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("consolidate", help="a sharded checkpoint directory -> one consolidated file")
    one.add_argument("directory")
    one.add_argument("file")
    many = commands.add_parser("shard", help="a consolidated checkpoint file -> a sharded directory")
    many.add_argument("file")
    many.add_argument("directory")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        consolidate(args.directory, args.file)
    else:
        shard(args.file, args.directory)


if __name__ == "__main__":
    main()
