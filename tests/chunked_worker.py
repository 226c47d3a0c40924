"""Worker side of the chunked-executor tests: ranks holding several stages, many plans in one group.

The model is shaped like user code: an input projection, residual MLP blocks, a block that
returns a tuple (hidden state and a gate) and one that consumes it, and a Linear head.
"""
from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import GroupsPerLayout
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan

STEPS = 3
CLIP = 0.05  # below the first steps' gradient norm: clipping scales every gradient
LR = 1e-2
WIDTH = 8
ROWS = 8


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Gate(nn.Module):
    """Returns a tuple, as blocks with a side output do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.sigmoid(self.linear(x))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, gate = state
        return x + gate * torch.tanh(self.linear(x))


def make_model() -> nn.Sequential:
    """8 layers: stage cuts [0,2) [2,3) [3,5) [5,8) put the tuple on boundary 1."""
    torch.manual_seed(4321)
    layers = [nn.Linear(6, WIDTH), Residual(), Gate(), Gated(), Residual(), Residual(), Residual(), nn.Linear(WIDTH, 3)]
    return nn.Sequential(*layers).double()


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(ROWS, 6, generator=g, dtype=torch.float64), torch.randn(ROWS, 3, generator=g, dtype=torch.float64)


class Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return F.mse_loss(forward(batch[0]), batch[1])


class EvalCallbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_output(self, batch: Any, forward: Any, weight: float) -> Any:
        return float(F.mse_loss(forward(batch[0]), batch[1])) * weight


def reference_run() -> tuple[list[dict[str, torch.Tensor]], list[float], float]:
    """Single-process training on the whole batch: per-layer state, losses, eval loss after."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = make_batch(STEPS)
        evaluated = float(F.mse_loss(model(x), y))
    return [copy.deepcopy(layer.state_dict()) for layer in model], losses, evaluated


# --------------------------------------------------------------------------- a looped schedule by hand


def looped_schedule(plan: Plan, split: bool = False) -> Schedule:
    """Every stage's forwards in pipeline order, then every backward in reverse (Megatron's
    looped breadth-first order, written out by hand): one global order, each group running
    its own stages' part of it. ``split``: backward as I, with each W after all Is."""
    stages, micro_batches = plan.num_stages, plan.micro_batches
    per_stage: list[list[Action]] = [[] for _ in range(stages)]
    merged: list[Action] = []

    def add(kind: Kind, stage: int, mb: int | None) -> None:
        action = Action(kind, stage, mb)
        per_stage[stage].append(action)
        merged.append(action)

    for stage in range(stages):
        for mb in range(micro_batches):
            if stage:
                add(Kind.RECV_ACT, stage, mb)
            add(Kind.F, stage, mb)
            if stage < stages - 1:
                add(Kind.SEND_ACT, stage, mb)
    for stage in reversed(range(stages)):
        for mb in range(micro_batches):
            if stage < stages - 1:
                add(Kind.RECV_GRAD, stage, mb)
            add(Kind.I if split else Kind.B, stage, mb)
            if stage:
                add(Kind.SEND_GRAD, stage, mb)
        for mb in range(micro_batches) if split else ():
            add(Kind.W, stage, mb)
    placement = plan.placement
    orders = tuple(tuple(a for a in merged if placement[a.stage] == group) for group in range(len(plan.device_groups)))
    return Schedule(
        name="looped",
        num_stages=stages,
        micro_batches=micro_batches,
        warmups=(micro_batches,) * stages,
        actions=tuple(tuple(actions) for actions in per_stage),
        recompute=tuple(stage.recompute for stage in plan.stages),
        placement=placement,
        orders=orders,
    )


def schedule_of(plan: Plan, kind: str) -> Schedule:
    if kind == "built":
        return schedule_for_plan(plan)
    return looped_schedule(plan, split=kind == "looped-split")


# --------------------------------------------------------------------------- cases


def _local_layers(model: nn.Sequential, plan: Plan, rank: int) -> list[nn.Module]:
    return [model[i] for stage in plan.stages_of_rank(rank) for i in range(plan.stages[stage].start, plan.stages[stage].end)]


def run_cases(rank: int, world: int, cases: Sequence[tuple], device: str = "cpu") -> list[dict | None]:
    """Each (plan data, schedule kind[, runner options]): train STEPS steps on ``device``,
    then one eval pass; the largest difference from the single-process run (on the CPU)."""
    failure = FailureChannel(rank, timeout_s=60)
    groups_of = GroupsPerLayout()
    ref_params, ref_losses, ref_eval = reference_run()
    out: list[dict | None] = []
    for plan_data, kind, *options in cases:
        plan = plan_from_dict(plan_data)
        groups = groups_of(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = make_model().to(device)
        local = _local_layers(model, plan, rank)
        runner = StageRunner.for_plan(
            plan, rank, local, torch.device(device), failure, groups=groups, ties=(), schedule=schedule_of(plan, kind), **(options[0] if options else {})
        )
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        replicas = plan.stages[plan.stages_of_rank(rank)[0]].replicas
        losses = []
        for step in range(STEPS):
            loss, _ = runner.train_step(tuple(t.to(device) for t in make_batch(step)), Callbacks())
            clip_grad_norm_global(runner.parameters, CLIP, replicas, failure, group=groups.plan)
            opt.step()
            losses.append(float(loss))
        evaluated = sum(runner.forward_step(tuple(t.to(device) for t in make_batch(STEPS)), EvalCallbacks()))
        runner.finish()
        diff = 0.0
        for stage in plan.stages_of_rank(rank):
            for index in range(plan.stages[stage].start, plan.stages[stage].end):
                for key, value in model[index].state_dict().items():
                    diff = max(diff, float((value.cpu() - ref_params[index][key]).abs().max()))
        out.append(
            {
                "param_diff": diff,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "eval_diff": abs(evaluated - ref_eval),
                "stages": plan.stages_of_rank(rank),
                "peak_in_flight": runner.stats.peak_in_flight,
                "recomputed": runner.stats.recomputed,
            }
        )
    return out


class FailsOnMarked(nn.Module):
    """``inner``, except that its forward raises on a micro-batch whose input is marked (huge)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs() > 1e5).any()):
            raise RuntimeError("forward failed")
        return self.inner(x)


def run_failure(rank: int, world: int, plan_data: dict, kind: str) -> dict:
    """Stage 2's second layer raises in the forward of micro-batch 1 (on the rank holding
    stage 2): what each rank raises, and how long it took. The failing rank reports and
    stays, so its blocked peer ends ``grace_s`` later (a short one here)."""
    failure = FailureChannel(rank, timeout_s=30, grace_s=3.0)
    plan = plan_from_dict(plan_data)
    groups = GroupsPerLayout()(plan)
    model = make_model()
    model[4] = FailsOnMarked(model[4])
    local = _local_layers(model, plan, rank)
    runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=(), schedule=schedule_of(plan, kind))
    x, y = make_batch(0)
    x[ROWS // plan.micro_batches : 2 * ROWS // plan.micro_batches] = 1e9  # micro-batch 1
    started = time.monotonic()
    try:
        runner.train_step((x, y), Callbacks())
    except Exception as exc:  # noqa: BLE001 -- the test reads what each rank raised
        failure.report(exc)
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    finally:
        failure.close()
    return {"type": "none", "message": "", "seconds": time.monotonic() - started}


# --------------------------------------------------------------------------- a tied GPT across groups


def run_tied_cases(rank: int, world: int, cases: Sequence[dict]) -> list[dict | None]:
    """The tied GPT (embedding on layer 0, its weight the head's on layer 4) under chunked
    plans whose tie spans two device groups: 3 Adam steps with clipping (the tie counted
    once), each rank's largest parameter difference from one process, and its tied copy."""
    from lightning_dapple.execute.tied import tied_groups
    from lightning_dapple.profile.ties import tied_parameters
    from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer
    from tied_models import gpt_batch, gpt_loss, tied_gpt_layers

    class GPTCallbacks:
        def make_input(self, batch: Any) -> Any:
            return batch[0]

        def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
            return gpt_loss(forward(batch[0]), batch[1])

    reference = tied_gpt_layers()
    opt = torch.optim.Adam(reference.parameters(), lr=LR)
    for step in range(STEPS):
        tokens, targets = gpt_batch(step)
        opt.zero_grad()
        gpt_loss(reference(tokens), targets).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        opt.step()
    failure = FailureChannel(rank, timeout_s=60)
    ties = tied_parameters(list(tied_gpt_layers()))
    groups_of = GroupsPerLayout()
    out: list[dict | None] = []
    for data in cases:
        plan = plan_from_dict(data)
        groups, tie_groups = groups_of(plan), tied_groups(plan, ties)  # collectives: every rank, every plan
        if rank >= plan.world_size:
            out.append(None)
            continue
        model = tied_gpt_layers()
        held = [i for stage in plan.stages_of_rank(rank) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
        kept = KeptTensors(model[i] for i in held)
        for other in [i for i in range(len(model)) if i not in held]:
            free_layer(model[other], kept)
        runner = StageRunner.for_plan(plan, rank, [model[i] for i in held], torch.device("cpu"), failure, groups=groups, ties=ties, tie_groups=tie_groups)
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        replicas = plan.stages[plan.stages_of_rank(rank)[0]].replicas
        for step in range(STEPS):
            runner.train_step(gpt_batch(step), GPTCallbacks())
            copies = runner.tied.copies if runner.tied is not None else None
            clip_grad_norm_global(runner.parameters, CLIP, replicas, failure, group=groups.plan, copies=copies)
            opt.step()
        runner.finish()
        diff = max(float((value - reference[i].state_dict()[key]).abs().max()) for i in held for key, value in model[i].state_dict().items())
        out.append({"param_diff": diff, "tied_copies": len(runner.tied.params) if runner.tied is not None else 0})
    return out
