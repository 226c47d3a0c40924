"""Worker side of the out-of-order backprop / recomputation tests: many cases per group.

A case is (model, plan dict, schedule, ooo, recompute). Models without dropout are
compared with single-device training (as in equivalence_worker); models with dropout
return their parameters so the parent can compare every variant of a plan with the same
plan run with ooo and recomputation off.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import toy_models
from equivalence_worker import CLIP, LR, STEPS, Callbacks, make_batch, reference_run
from lightning_dapple.execute.clipping import clip_grad_norm_global
from dist_harness import GroupsPerLayout
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict


class DropBlock(nn.Module):
    def __init__(self, width_in: int, width_out: int, p: float = 0.3) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.linear(x)))


class DropEncoderBlock(toy_models.EncoderBlock):
    """The toy encoder block with dropout in attention and after the feed-forward."""

    def __init__(self, width: int, heads: int = 2, p: float = 0.2) -> None:
        super().__init__(width, heads)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True, dropout=p)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p), nn.Linear(2 * width, width))


class WideBlock(nn.Module):
    """A layer with a heavy weight gradient relative to its input gradient and stash."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def make_model(name: str) -> nn.Sequential:
    torch.manual_seed(1234)
    if name in ("mlp", "transformer"):
        layers = toy_models.mlp_layers() if name == "mlp" else toy_models.transformer_layers()
    elif name == "mlp-dropout":
        sizes = (6, 10, 12, 10, 8, 3)
        layers = nn.Sequential(*[DropBlock(a, b) for a, b in zip(sizes[:-2], sizes[1:-1])], nn.Linear(sizes[-2], sizes[-1]))
    elif name == "transformer-dropout":
        layers = nn.Sequential(toy_models.Embed(11, 8), *[DropEncoderBlock(8) for _ in range(3)], toy_models.Head(8, 11))
    elif name == "wide":
        layers = nn.Sequential(nn.Linear(6, 64), *[WideBlock(64) for _ in range(3)], nn.Linear(64, 3))
    else:
        raise ValueError(name)
    return layers.double()


def base_name(name: str) -> str:
    return "transformer" if name.startswith("transformer") else "mlp"


def loss_name(name: str) -> str:
    return base_name(name)


def with_options(plan_data: dict, schedule: str, ooo: bool, recompute: "str | list[str]") -> dict:
    stages = []
    for index, stage in enumerate(plan_data["stages"]):
        mode = recompute if isinstance(recompute, str) else recompute[index]
        stages.append({**stage, "recompute": mode})
    return {**plan_data, "stages": stages, "schedule": schedule, "ooo": ooo}


def run_cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict | None]:
    """``cases``: (model name, full plan dict). Returns per case this rank's result."""
    failure = FailureChannel(rank, timeout_s=60)
    references: dict[str, Any] = {}
    groups_for = GroupsPerLayout()
    out: list[dict | None] = []
    for index, (name, plan_data) in enumerate(cases):
        plan = plan_from_dict(plan_data)
        groups = groups_for(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = make_model(name)
        stage = plan.stages[plan.stage_of_rank(rank)]
        local = [model[i] for i in range(stage.start, stage.end)]
        # both receive paths: posted one transfer ahead (every other case) and posted when due
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, post_ahead=index % 2 == 0, ties=())
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        losses, peaks, stash, recomputed = [], [], [], []
        for step in range(STEPS):
            loss, _ = runner.train_step(make_batch(base_name(name), step), Callbacks(loss_name(name)))
            clip_grad_norm_global(runner.parameters, CLIP, stage.replicas, failure, group=groups.plan)
            opt.step()
            losses.append(float(loss))
            peaks.append(runner.stats.peak_in_flight)
            stash.append(runner.stats.peak_stash_bytes)
            recomputed.append(runner.stats.recomputed)
        runner.finish()
        kinds = sorted({kind for _, _, kind, *_ in runner.stats.timeline})
        result: dict[str, Any] = {
            "losses": losses,
            "peak_in_flight": max(peaks),
            "peak_stash_bytes": max(stash),
            "recomputed": recomputed[-1],
            "stage": plan.stage_of_rank(rank),
            "kinds": kinds,
            # a plain list: tensors would travel by shared memory the exiting child releases
            "params": torch.cat([p.detach().reshape(-1) for layer in local for p in layer.parameters()]).tolist(),
        }
        if name in ("mlp", "transformer", "wide"):
            if name not in references:
                references[name] = _reference(name)
            ref_params, ref_losses, _ = references[name]
            diff = 0.0
            for offset, layer in enumerate(local):
                for key, value in layer.state_dict().items():
                    diff = max(diff, float((value - ref_params[stage.start + offset][key]).abs().max()))
            result["param_diff"] = diff
            result["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out.append(result)
    return out


def _reference(name: str) -> Any:
    if name in ("mlp", "transformer"):
        return reference_run(name)
    import copy

    model = make_model(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = make_batch("mlp", step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(float(loss))
    return [copy.deepcopy(layer.state_dict()) for layer in model], losses, None
