"""Worker side of ``test_stash_bytes.py``: the executor's peak stashed bytes on a model whose
stash can be counted by hand.

Each layer is ``h = x * 1.0`` (a fresh tensor; a product with a Python number saves
nothing), ``Linear(h)`` (saves ``h``), then two ``tanh`` (each saves its result). So a
micro-batch slice of ``r`` rows stashes three ``r x WIDTH`` float64 tensors per layer, none
shared with another layer, and a split backward leaves each Linear's input and output
gradient (two per layer) to its W.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import GroupsPerLayout
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict

WIDTH = 4
LAYERS = 4
ROWS = 8
STEPS = 2  # the first measures the stash sizes, the second reuses them
FLOAT64 = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(self.linear(x * 1.0)))


def make_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(*[Block() for _ in range(LAYERS)]).double()


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64), torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)


def slice_bytes(plan_data: dict) -> int:
    """Bytes of one ``rows x WIDTH`` float64 tensor of a micro-batch slice (one replica per stage)."""
    return ROWS // plan_data["micro_batches"] * WIDTH * FLOAT64


class Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return F.mse_loss(forward(batch[0]), batch[1])


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict | None]:
    """Per plan: this rank's stages and its peak stashed bytes and micro-batches in flight,
    per step."""
    failure = FailureChannel(rank, timeout_s=60)
    groups_for = GroupsPerLayout()
    out: list[dict | None] = []
    for plan_data in cases:
        plan = plan_from_dict(plan_data)
        groups = groups_for(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = make_model()
        local = [model[i] for stage in plan.stages_of_rank(rank) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=())
        opt = torch.optim.SGD(runner.parameters, lr=0.1)
        peaks, in_flight = [], []
        for step in range(STEPS):
            runner.train_step(make_batch(step), Callbacks())
            opt.step()
            peaks.append(runner.stats.peak_stash_bytes)
            in_flight.append(runner.stats.peak_in_flight)
        runner.finish()
        out.append({"stages": plan.stages_of_rank(rank), "peak_stash_bytes": peaks, "peak_in_flight": in_flight})
    return out
