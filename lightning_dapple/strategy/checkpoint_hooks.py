"""The checkpoint hooks of ``DappleStrategy``: state dicts gathered from the stages (consolidated,
``checkpoint.py``) or written by each stage leader (sharded, ``sharded_checkpoint.py``), and
loaded back under any plan.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.strategy import checkpoint as ckpt
from lightning_dapple.strategy import sharded_checkpoint as sharded
from lightning_dapple.strategy.part_stream import PartLane, open_part_lane, to_host


class CheckpointHooks:
    """Part of :class:`~lightning_dapple.strategy.dapple_strategy.DappleStrategy` (module docstring);
    its methods read the strategy's state, set up in ``DappleStrategy.__init__``."""

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load a checkpoint into the stage-local module after ``setup`` has converted it
        (e.g. to float64 under 64-true): loading first would round the weights through the
        module's original dtype."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state, gathered from the stages on rank 0 (under "sharded":
        this rank's own entries, nothing gathered). In a process that set no pipeline up
        (the one that spawned the ranks, which holds the trained model after fit), the
        module's own, as under ``ddp_spawn``."""
        if self.checkpoint_layout is None:
            return super().lightning_module_state_dict()
        if self._sharded:
            return sharded.local_state_dict(self.lightning_module, self.checkpoint_layout)
        return ckpt.consolidated_state_dict(self.lightning_module, self.checkpoint_layout, self._checkpoint_lane())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.checkpoint_layout is None:  # as lightning_module_state_dict
            return super().optimizer_state(optimizer)
        if self._sharded:
            return sharded.local_optimizer_state(self.lightning_module, self.checkpoint_layout, optimizer)
        return ckpt.consolidated_optimizer_state(self.lightning_module, self.checkpoint_layout, optimizer, self._checkpoint_lane())

    @property
    def _sharded(self) -> bool:
        """Whether saves write sharded directories (a pipeline is set up and asked for them)."""
        return self.checkpoint_mode == "sharded" and self.checkpoint_layout is not None

    def _checkpoint_lane(self) -> PartLane:
        """The gloo path checkpoint parts take to rank 0 (``part_stream.py``), with, under
        "sharded", the writers' group (``sharded_checkpoint.WriterLane``); opened at the
        first save: every rank saves at the same point, as opening a group requires."""
        if self._part_lane is None:
            assert self.failure is not None
            lane = open_part_lane(ckpt.PartTurns(self.failure), timedelta(seconds=self.timeout_s))  # parts in turn (checkpoint.py)
            if self._sharded:
                assert self.checkpoint_layout is not None
                lane = sharded.open_writer_lane(lane, self.checkpoint_layout, self.timeout_s)
            self._part_lane = lane
        return self._part_lane

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory gives Lightning its ``meta.pt``, the model and
        optimizer entries staying in the files until ``load_model_state_dict`` and
        ``load_optimizer_state_dict`` read this rank's; a file loads as under DDP."""
        if sharded.is_sharded(checkpoint_path):
            return sharded.load_meta(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if isinstance(checkpoint["state_dict"], sharded.ShardedSource):
            sharded.load_local_model(self.lightning_module, self.checkpoint_layout, checkpoint["state_dict"], strict=strict)
            return
        ckpt.load_local_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self.checkpoint_layout is not None
        states = checkpoint["optimizer_states"]
        if states and isinstance(states[0], sharded.ShardedSource):
            sharded.load_local_optimizers(self.lightning_module, self.checkpoint_layout, self.optimizers, states)
            return
        ckpt.load_local_optimizer_states(self.lightning_module, self.checkpoint_layout, self.optimizers, states)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Rank 0 writes the file, every tensor in it on the CPU: the model and optimizer
        parts arrive there, and what Lightning adds (a callback's best score, a metric) is
        moved here, so the file loads on a machine without the devices that wrote it.

        Under "sharded", ``filepath`` becomes a directory: rank 0 makes a temporary one
        beside it, each writer (stage leader, rank 0) stores its part there, and rank 0
        swaps it in (``sharded_checkpoint.py``)."""
        if self._sharded:
            assert self.checkpoint_layout is not None
            require(storage_options is None, "save_checkpoint(storage_options)", "is given under checkpoint='sharded'",
                    "leave it out: the writers store through torch.distributed.checkpoint, not the CheckpointIO")
            staged = sharded.prepare_target(filepath) if self.is_global_zero else None
            target, staging = self.broadcast(staged)
            sharded.save_part(checkpoint, staging, self.checkpoint_layout, self._checkpoint_lane())
            if self.is_global_zero:
                sharded.publish(staging, target)
            return
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(to_host(checkpoint), filepath, storage_options=storage_options)

    @override
    @property
    def checkpoint_io(self) -> Any:
        if self._checkpoint_io is None:
            self._checkpoint_io = ckpt.AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io
