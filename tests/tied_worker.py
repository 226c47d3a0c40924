"""Worker side of the tied-weight executor tests: many plans in one process group.

Each rank builds the tied GPT, frees the layers of the other stages as the strategy does
(``strategy/tied_layers.free_layer``: a kept tied weight stays real), runs 3 Adam steps
with global-norm clipping and reports its parameters' relative difference from a plain
single-process run, the clipping norms, and its copy of the tied weight.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.tied import tied_groups
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.ties import tied_parameters
from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer
from tied_models import gpt_batch, gpt_loss, tied_gpt_layers

STEPS = 3
CLIP = 0.5
LR = 1e-2


class Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return gpt_loss(forward(batch[0]), batch[1])


def reference_run() -> tuple[list[dict[str, torch.Tensor]], list[float], list[float]]:
    """One process on the whole global batch: per-layer state, losses, clipping norms."""
    model = tied_gpt_layers()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, targets = gpt_batch(step)
        opt.zero_grad()
        loss = gpt_loss(model(tokens), targets)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss))
    return [copy.deepcopy(layer.state_dict()) for layer in model], losses, norms


def _scale(layers: list[dict[str, torch.Tensor]]) -> float:
    """The largest absolute parameter value of the reference model (what differences are
    relative to)."""
    return max(float(value.abs().max()) for state in layers for value in state.values() if value.is_floating_point())


def _on(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in batch)


def run_cases(rank: int, world: int, cases: list[dict], device: str = "cpu") -> list[dict | None]:
    """``cases``: plan dicts (with schedule, ooo and recompute). Per case this rank's result.
    ``device``: where the stage runs ("cuda:0": every rank on one GPU, gloo with pinned
    staging); the reference runs on the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    failure = FailureChannel(rank, timeout_s=60)
    ref_layers, ref_losses, ref_norms = reference_run()
    ties = tied_parameters(list(tied_gpt_layers()))
    made: dict[Any, Any] = {}  # process groups per device layout (every rank makes them in the same order)
    out: list[dict | None] = []
    for index, data in enumerate(cases):
        plan = plan_from_dict(data)
        layout = tuple(stage.devices for stage in plan.stages)
        if layout not in made:
            made[layout] = (build_groups(plan), tied_groups(plan, ties))
        groups, tie_groups = made[layout]
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = tied_gpt_layers().to(dev)  # in place: the tie stays one Parameter
        stage = plan.stages[plan.stage_of_rank(rank)]
        kept = KeptTensors(model[i] for i in range(stage.start, stage.end))
        for other in [i for i in range(len(model)) if not stage.start <= i < stage.end]:
            free_layer(model[other], kept)
        local = [model[i] for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(
            plan, rank, local, dev, failure, groups=groups, ties=ties, tie_groups=tie_groups, post_ahead=index % 2 == 0
        )
        tied = runner.tied
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        losses, norms = [], []
        for step in range(STEPS):
            loss, _ = runner.train_step(_on(gpt_batch(step), dev), Callbacks())
            copies = tied.copies if tied is not None else None
            norms.append(float(clip_grad_norm_global(runner.parameters, CLIP, stage.replicas, failure, group=groups.plan, copies=copies)))
            opt.step()
            losses.append(float(loss.detach()))
        runner.finish()
        diff = max(
            float((value.cpu() - ref_layers[stage.start + offset][key]).abs().max())
            for offset, layer in enumerate(local)
            for key, value in layer.state_dict().items()
        )
        copy_of_tie = [p for p in (tied.params if tied is not None else [])]
        out.append(
            {
                "stage": plan.stage_of_rank(rank),
                "relative_diff": diff / _scale(ref_layers),
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
                "reference_norms": ref_norms,
                "tied_copy": copy_of_tie[0].detach().cpu().reshape(-1).tolist() if copy_of_tie else None,
                "tied_in_runner": len(copy_of_tie),
                "parameters": len(runner.parameters),
            }
        )
    return out
