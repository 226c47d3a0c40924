"""Worker side of the out-of-order backprop memory and gradient-bucket tests."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from equivalence_worker import CLIP, LR, Callbacks, make_batch, make_model, reference_run
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict


def _runner(
    rank: int, plan_data: dict, name: str, failure: FailureChannel, bucket_bytes: int | None = None, groups: Any = None
) -> tuple[StageRunner, list]:
    plan = plan_from_dict(plan_data)
    model = make_model(name)
    stage = plan.stages[plan.stage_of_rank(rank)]
    local = [model[i] for i in range(stage.start, stage.end)]
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, **extra, ties=())
    return runner, local


def live_after_next_step(rank: int, world: int, plan_data: dict, name: str) -> dict[str, Any]:
    """Weak references to every layer output (and so to the autograd graph that saves
    them) of step 3: how many are alive after step 4, with the garbage collector off so
    that only reference counting frees them (a graph kept in a reference cycle shows)."""
    failure = FailureChannel(rank, timeout_s=60)
    runner, local = _runner(rank, plan_data, name, failure)
    opt = torch.optim.SGD(runner.parameters, lr=1e-2)
    refs: list[weakref.ref] = []
    recording = [False]

    def keep(_module: Any, _inputs: Any, output: Any) -> None:
        if recording[0]:
            leaves = [output] if isinstance(output, torch.Tensor) else [v for v in output.values() if isinstance(v, torch.Tensor)]
            refs.extend(weakref.ref(t) for t in leaves)

    for layer in local:
        layer.register_forward_hook(keep)
    gc.collect()
    gc.disable()
    try:
        for step in range(5):
            recording[0] = step == 3
            runner.train_step(make_batch(name, step), Callbacks(name))
            opt.step()
            if step == 3:
                after_own_step = sum(r() is not None for r in refs)
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    runner.finish()
    return {"recorded": len(refs), "alive": alive, "after_own_step": after_own_step, "split": runner.split}


def bucketed_parameters(rank: int, world: int, cases: list[tuple[str, dict, int | None]]) -> list[dict[str, Any] | None]:
    """Per case: parameter gap to single-device training after 3 steps, and how many
    gradient buckets started before the end of the last step (None: rank not in the plan)."""
    failure = FailureChannel(rank, timeout_s=60)
    out: list[dict[str, Any] | None] = []
    for name, plan_data, bucket_bytes in cases:
        plan = plan_from_dict(plan_data)
        groups = build_groups(plan)  # a collective: every rank, every case
        if rank >= plan.world_size:
            out.append(None)
            continue
        runner, local = _runner(rank, plan_data, name, failure, bucket_bytes, groups)
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        for step in range(3):
            runner.train_step(make_batch(name, step), Callbacks(name))
            clip_grad_norm_global(runner.parameters, CLIP, runner.stage_plan.replicas, failure, group=runner.groups.plan)
            opt.step()
        runner.finish()
        ref_params, _, _ = reference_run(name)
        start = runner.stage_plan.start
        gap = max(
            float((value - ref_params[start + offset][key]).abs().max())
            for offset, layer in enumerate(local)
            for key, value in layer.state_dict().items()
        )
        sync = runner.sync
        out.append({"gap": gap, "buckets": sync.num_buckets if sync else 0, "early": sync.launched_early if sync else 0})
    return out

