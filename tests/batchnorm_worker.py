"""Worker side of the BatchNorm tests: a CNN with BatchNorm layers on many plans in one group.

A case is (mode, plan dict): mode "default" (plain BatchNorm), "sync" (statistics over the
stage's replicas), "deferred" (running statistics once per step) or "both". Each rank
trains its stage for ``STEPS`` steps (float64, Adam) and returns its layers' state and the
model's evaluation on a held-out batch; ``reference_run`` is the single process the test
compares them with.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from lightning_dapple.execute.batchnorm import convert_batchnorm
from dist_harness import GroupsPerLayout
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.slicing import microbatch_rows, slice_rows
from lightning_dapple.plan.plan import plan_from_dict

STEPS = 3
LR = 1e-2
ROWS = 24
MODES = {"default": (False, False), "sync": (True, False), "deferred": (False, True), "both": (True, True)}


class ConvBlock(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width_in, width_out, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class PoolHead(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_model() -> nn.Sequential:
    """Five layers; BatchNorm inside layers 0 and 1, and layer 3 is one (cumulative average)."""
    torch.manual_seed(1234)
    layers = nn.Sequential(
        ConvBlock(3, 4), ConvBlock(4, 6), PoolHead(6, 8), nn.BatchNorm1d(8, momentum=None), nn.Sequential(nn.ReLU(), nn.Linear(8, 3))
    )
    return layers.double()


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 3, 5, 5, generator=generator, dtype=torch.float64) * 2 + 1
    return x, torch.randint(0, 3, (ROWS,), generator=generator)


class Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return F.cross_entropy(forward(batch[0]), batch[1])


class EvalCallbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_output(self, batch: Any, forward: Any, weight: float) -> Any:
        return forward(batch[0]).detach()


def run_cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict | None]:
    """Per case: this rank's stage, replica, layer states after training and evaluation output."""
    failure = FailureChannel(rank, timeout_s=60)
    groups_for = GroupsPerLayout()
    out: list[dict | None] = []
    for mode, plan_data in cases:
        plan = plan_from_dict(plan_data)
        groups = groups_for(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        index = plan.stage_of_rank(rank)
        stage = plan.stages[index]
        replica = stage.devices.index(rank)
        model = make_model()
        sync, deferred = MODES[mode]
        scope = [model[i] for i in range(stage.start, stage.end)]
        convert_batchnorm(model, scope, groups.replicas.get(index), replica, stage.replicas, sync, deferred)
        local = [model[i] for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=())
        _replace_buffers(local)  # as a move to the device does, after the runner was built
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        for step in range(STEPS):
            runner.train_step(make_batch(step), Callbacks())
            opt.step()
        for layer in local:
            layer.eval()
        evaluated = runner.forward_step(make_batch(STEPS), EvalCallbacks())
        runner.finish()
        # numpy arrays travel to the parent by value (tensors would be shared with a process that exits)
        states = {stage.start + offset: {k: v.numpy().copy() for k, v in layer.state_dict().items()} for offset, layer in enumerate(local)}
        out.append({"stage": index, "replica": replica, "state": states, "eval": torch.cat(evaluated).numpy()})
    return out


def _replace_buffers(layers: list[nn.Module]) -> None:
    for layer in layers:
        for module in layer.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.clone()


def reference_run(mode: str, replicas: int, micro_batches: int) -> tuple[nn.Sequential, torch.Tensor]:
    """One process, the same global batches, what each mode computes (module docstring of
    ``execute/batchnorm.py``): each normalisation group (a replica's slice of a micro-batch,
    or the whole micro-batch under sync) runs forward and backward with its loss weighted by
    its rows; running statistics follow replica 0's slices by default (the broadcast), every
    micro-batch under sync, and with deferral one plain BatchNorm update per step from
    everything the module saw, as one device that saw the global batch. Returns the trained
    model and its evaluation of the held-out batch."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sync, deferred = MODES[mode]
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    seen: dict[int, list[torch.Tensor]] = {id(m): [] for m in norms}
    for norm in norms:
        norm.register_forward_pre_hook(lambda module, args: seen[id(module)].append(args[0].detach()) if module.training else None)
    for step in range(STEPS):
        x, y = make_batch(step)
        opt.zero_grad()
        for values in seen.values():
            values.clear()
        for mb in range(micro_batches):
            for replica in range(1 if sync else replicas):
                lo, hi = microbatch_rows(ROWS, micro_batches, mb) if sync else slice_rows(ROWS, micro_batches, mb, replicas, replica)
                kept = deferred or replica != 0
                saved = [{k: v.clone() for k, v in m._buffers.items() if v is not None} for m in norms] if kept else []
                (F.cross_entropy(model(x[lo:hi]), y[lo:hi]) * ((hi - lo) / ROWS)).backward()
                for module, values in zip(norms, saved):
                    for name, value in values.items():
                        module._buffers[name].copy_(value)  # type: ignore[union-attr]
        if deferred:
            with torch.no_grad():
                for norm in norms:
                    norm(torch.cat(seen[id(norm)]))
        opt.step()
    model.eval()
    with torch.no_grad():
        return model, model(make_batch(STEPS)[0])


class CNNModule(LightningModule):
    """The CNN as people write it for Lightning: the layers under ``self.layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=LR)


def cnn_loader(steps: int = STEPS) -> DataLoader:
    xs, ys = zip(*(make_batch(step) for step in range(steps)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=ROWS, shuffle=False)


class StateDump(Callback):
    """Each rank's module state (its stage's layers) when training ends, in ``state_rank<r>.pt``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        torch.save({k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}, f"{self.directory}/state_rank{trainer.global_rank}.pt")

