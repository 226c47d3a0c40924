"""Worker side of the traced-layer equivalence test: every plan in one process group, the
layer list traced from forward on each rank, against one process."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.traced_layers import traced_layers
from lightning_dapple.strategy.module_adapter import key_owners

from traced_toys import LR, NanoGPT, SkipMasked, SmallResNet, image_loader, plain_run, relative_difference, token_loader

STEPS = 3
MODELS = {"nanogpt": (NanoGPT, token_loader), "resnet": (SmallResNet, image_loader), "skip": (SkipMasked, token_loader)}


def _loss(name: str, output: torch.Tensor, batch: Any) -> torch.Tensor:
    if name != "resnet":
        return F.cross_entropy(output.reshape(-1, output.size(-1)), batch[1].reshape(-1))
    return F.cross_entropy(output, batch[1])


class _Callbacks:
    def __init__(self, name: str) -> None:
        self.name = name

    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return _loss(self.name, forward(batch[0]), batch)


def run_traced_cases(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict | None]:
    """Per case: this rank's largest relative parameter difference from one process after
    ``STEPS`` Adam steps, and the number of traced layers."""
    failure = FailureChannel(rank, timeout_s=60)
    references: dict[str, dict[str, torch.Tensor]] = {}
    out: list[dict | None] = []
    for name, plan_data in cases:
        plan = plan_from_dict(plan_data)
        groups = build_groups(plan)
        if rank >= plan.world_size:
            out.append(None)
            continue
        make_model, make_loader = MODELS[name]
        if name not in references:
            references[name] = plain_run(make_model(), make_loader(), STEPS)
        module = make_model().double()
        batch = [t.double() if t.is_floating_point() else t for t in next(iter(make_loader()))]
        layers = traced_layers(module, [(batch[0][:1],), (batch[0][:2],)])
        stage = plan.stages[plan.stage_of_rank(rank)]
        local = [layers[i] for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=())
        optimizer = torch.optim.Adam(runner.parameters, lr=LR)
        for _, batch in zip(range(STEPS), make_loader()):
            batch = [t.double() if t.is_floating_point() else t for t in batch]
            runner.train_step(batch, _Callbacks(name))
            optimizer.step()
        runner.finish()
        owners = key_owners(module, layers)
        state = module.state_dict()
        mine = [key for key, owner in owners.items() if owner is not None and stage.start <= owner < stage.end]
        difference = relative_difference({k: state[k] for k in mine}, {k: references[name][k] for k in mine})
        out.append({"difference": difference, "layers": len(layers), "keys": len(mine)})
    return out
