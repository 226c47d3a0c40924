"""Worker side of the executor equivalence tests: every plan x schedule in one process group."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict

import toy_models

STEPS = 3
CLIP = 0.5
LR = 1e-2


def make_model(name: str) -> torch.nn.Sequential:
    torch.manual_seed(1234)
    layers = toy_models.mlp_layers() if name == "mlp" else toy_models.transformer_layers()
    return layers.double()


def make_batch(name: str, step: int) -> Any:
    return toy_models.mlp_batch(step) if name == "mlp" else toy_models.token_batch(step)


def loss_of(name: str, output: torch.Tensor, batch: Any) -> torch.Tensor:
    if name == "mlp":
        return F.mse_loss(output, batch[1])
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


class Callbacks:
    def __init__(self, name: str) -> None:
        self.name = name

    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return loss_of(self.name, forward(batch[0]), batch)


def reference_run(name: str) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """Single-process training on the whole global batch: per-layer params, losses, norms."""
    model = make_model(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        batch = make_batch(name, step)
        opt.zero_grad()
        loss = loss_of(name, model(batch[0]), batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss))
    return [copy.deepcopy(layer.state_dict()) for layer in model], losses, norms


def run_cases(rank: int, world: int, cases: list[tuple[str, dict, str]]) -> list[dict | None]:
    failure = FailureChannel(rank, timeout_s=60)
    references: dict[str, Any] = {}
    out: list[dict | None] = []
    for index, (name, plan_data, schedule) in enumerate(cases):
        plan = plan_from_dict({**plan_data, "schedule": schedule})
        groups = build_groups(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        if name not in references:
            references[name] = reference_run(name)
        ref_params, ref_losses, _ = references[name]
        model = make_model(name)
        stage = plan.stages[plan.stage_of_rank(rank)]
        local = [model[i] for i in range(stage.start, stage.end)]
        # both receive paths: posted one transfer ahead (alternate pairs of cases, so each
        # schedule meets both) and posted when due
        post_ahead = (index // 2) % 2 == 0
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, post_ahead=post_ahead, ties=())
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        losses, peaks, stash = [], [], []
        for step in range(STEPS):
            loss, _ = runner.train_step(make_batch(name, step), Callbacks(name))
            clip_grad_norm_global(runner.parameters, CLIP, stage.replicas, failure, group=groups.plan)
            opt.step()
            losses.append(float(loss))
            peaks.append(runner.stats.peak_in_flight)
            stash.append(runner.stats.peak_stash_bytes)
        runner.finish()
        diff = 0.0
        for offset, layer in enumerate(local):
            for key, value in layer.state_dict().items():
                diff = max(diff, float((value - ref_params[stage.start + offset][key]).abs().max()))
        out.append(
            {
                "param_diff": diff,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "peak_in_flight": max(peaks),
                "peak_stash_bytes": max(stash),
                "warmup": plan.with_warmups().stages[plan.stage_of_rank(rank)].warmup,
                "stage": plan.stage_of_rank(rank),
            }
        )
    return out
