"""``plan="auto"``: profile the layers on a real micro-batch and run the bundled planner.

Rank 0 profiles the whole layer list once (layer by layer, lightning_dapple.profile) on
a slice of the first training batch, plans for the real world size and global batch
(DAPPLE 4), and broadcasts the plan so every rank executes the same one. The cluster is
the one given to the strategy, or this machine as detected (``cluster.detect_cluster``:
the Trainer's nodes x devices per node, the GPUs' name and memory, else the host's
memory per CPU process). The plan records the cluster it was made for in
``extra["cluster"]``, so the plan file names the memory it was fitted into.

Profiling runs layer by layer (only one layer on the device at a time) on one
micro-batch slice that stays where the module lives, under autocast when the Trainer
trains in mixed precision, so the times are those of the precision that will run.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_dapple.cluster import Cluster, detect_cluster, load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.slicing import batch_size_of
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.strategy.ooo_choice import decide_ooo, with_ooo_choice

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn

    from lightning_dapple.strategy.dapple_strategy import DappleStrategy


def default_cluster(strategy: "DappleStrategy") -> Cluster:
    """This machine, as the Trainer uses it (nodes x processes per node)."""
    accelerator = "gpu" if strategy.root_device.type == "cuda" else "cpu"
    return detect_cluster(max(1, strategy.num_nodes), max(1, strategy.num_processes), accelerator)


def auto_plan(strategy: "DappleStrategy", trainer: "Trainer", module: "LightningModule", container: "nn.Module", sample: Any) -> Plan:
    saved = Path(trainer.log_dir or trainer.default_root_dir) / "dapple_plan.json"
    if trainer.ckpt_path and saved.is_file():
        from lightning_dapple.plan.plan import load_plan

        return load_plan(saved)  # resuming reuses the plan of the run
    data: Any = None
    if strategy.global_rank == 0:
        try:
            data = _plan_on_rank_zero(strategy, module, container, sample, saved.parent)
        except DappleConfigError as exc:  # shared with every rank so all stop with the same message
            data = {"__error__": [exc.field, exc.problem, exc.fix]}
        except Exception as exc:
            data = {"__error__": ["plan='auto'", f"planning failed on rank 0: {type(exc).__name__}: {exc}", "pass an explicit plan to bypass the planner"]}
    if dist.is_initialized() and dist.get_world_size() > 1:
        holder = [data]
        dist.broadcast_object_list(holder, src=0)
        data = holder[0]
    if "__error__" in data:
        raise DappleConfigError(*data["__error__"])  # the planner's own what/problem/fix, once
    return plan_from_dict(data)


def _plan_on_rank_zero(strategy: "DappleStrategy", module: "LightningModule", container: "nn.Module", sample: Any, directory: Path) -> dict[str, Any]:
    from lightning_dapple.execute.slicing import take_rows
    from lightning_dapple.strategy.module_adapter import LogRecorder, capture_input

    from lightning_dapple.simulate.plans import make_plan
    from lightning_dapple.profile.profiler import profile_layers

    rows = batch_size_of(sample)
    per_device = max(1, rows // max(1, strategy.world_size))
    piece = take_rows(sample, 0, per_device)
    with LogRecorder().recording(module, 0.0):
        x = capture_input(module, lambda: module.training_step(piece, 0))
    profile = profile_layers(
        container,
        x,
        device=strategy.root_device,
        cache_dir=strategy.profile_cache,
        name=type(module).__name__,
        autocast_dtype=strategy.autocast_dtype(),
    )
    cluster = load_cluster(strategy.cluster_spec) if strategy.cluster_spec is not None else default_cluster(strategy)
    kwargs: dict[str, Any] = {}
    if strategy.micro_batches is not None:
        kwargs["micro_batches"] = strategy.micro_batches
    if strategy.schedule_name is not None:
        kwargs["schedule"] = strategy.schedule_name
    if strategy.policy in ("PA", "PB"):
        kwargs["policy"] = strategy.policy
    plan = make_plan(profile, cluster, rows, num_devices=strategy.world_size, **kwargs)
    modes = strategy.recompute if strategy.recompute is not None else [stage.recompute for stage in plan.stages]
    on, why = decide_ooo(strategy.ooo, plan, profile, cluster, recompute=modes)
    if strategy.recompute == "auto":
        from lightning_dapple.simulate.memory_fit import apply_ooo_recompute

        plan = apply_ooo_recompute(plan, profile, cluster, ooo=on, recompute="auto")
    plan = with_ooo_choice(plan, on, why)
    from dataclasses import replace

    from lightning_dapple.plan.plan import atomic_write_text

    plan = replace(plan, extra={**plan.extra, "cluster": cluster.to_dict()})
    atomic_write_text(directory / "dapple_profile.json", profile.to_json() + "\n")
    strategy._planning_inputs = (profile, cluster)
    return plan.to_dict()
