"""Worker side of the test that the executor's gradient buckets under out-of-order backprop
are the simulator's: which layers each bucket holds and the order they are launched in."""
from __future__ import annotations

from typing import Any

import torch

from equivalence_worker import Callbacks, make_batch
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from memory_worker import _runner


def launched_buckets(rank: int, world: int, cases: list[tuple[str, dict, int]]) -> list[dict[str, Any]]:
    """Per case (model, plan, bucket bytes): the stage-local layer range of every bucket of
    the runner's ``GradientSync`` in launch order during one training step, and how many
    were launched before the step's end (as soon as their last W was done)."""
    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=60)
    out: list[dict[str, Any]] = []
    for name, plan_data, bucket_bytes in cases:
        runner, local = _runner(rank, plan_data, name, failure, bucket_bytes, build_groups_once(plan_data))
        sync = runner.sync
        assert sync is not None, "the stage is replicated: it must have a GradientSync"
        layer_of = {id(p): index for index, layer in enumerate(local) for p in layer.parameters()}
        order: list[tuple[int, int]] = []
        launch = sync._launch

        def record(bucket: Any, launch: Any = launch) -> None:
            layers = [layer_of[id(p)] for p in bucket.params]
            order.append((min(layers), max(layers) + 1))
            launch(bucket)

        sync._launch = record  # type: ignore[method-assign]
        runner.train_step(make_batch(name, 0), Callbacks(name))
        runner.finish()
        out.append({"launched": order, "early": sync.launched_early, "split": runner.split})
    return out


_GROUPS: dict[str, Any] = {}


def build_groups_once(plan_data: dict) -> Any:
    """Process groups per device layout (a collective: every rank builds them in one order)."""
    from lightning_dapple.plan.plan import plan_from_dict

    plan = plan_from_dict(plan_data)
    key = repr([stage.devices for stage in plan.stages])
    if key not in _GROUPS:
        _GROUPS[key] = build_groups(plan)
    return _GROUPS[key]
