"""Gradient clipping by the global norm over all stages (each parameter counted once).

A pipeline rank holds only its stage's parameters; clipping by the local norm would give
each stage a different scale and break equivalence with single-device training. Each rank
contributes its squared norm divided by its stage's replica count (replicas hold equal
gradients after the AllReduce), the sum over the plan is the squared global norm, and the
clip coefficient is the one ``torch.nn.utils.clip_grad_norm_`` would use on one device.
A tied parameter held by several stages (``execute/tied.py``) has the same summed gradient
on every rank holding a copy; ``copies`` gives that rank count, and each copy contributes
its square divided by it, so the parameter counts once.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import collective_device


def global_grad_norm(
    params: Iterable[torch.Tensor], replicas: int, failure: FailureChannel | None, group: Any = None, copies: Mapping[int, int] | None = None
) -> torch.Tensor:
    """The norm over all stages, summed where the gradients live (one copy at the end, not
    one per parameter) and reduced on the device the plan's backend takes; ``copies``:
    id(tied parameter) -> ranks holding its gradient."""
    params = [p for p in params if p.grad is not None]
    shared = copies or {}
    grads = [p.grad.detach() for p in params if id(p) not in shared]
    device = params[0].grad.device if params else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        local += grad.to(torch.float64).pow(2).sum()
    local /= replicas
    for param in params:
        if id(param) in shared:  # a tied parameter: every copy holds the whole gradient
            local += param.grad.detach().to(torch.float64).pow(2).sum() / shared[id(param)]
    if failure is not None and dist.is_initialized():
        local = local.to(collective_device(group, device))
        failure.wait(dist.all_reduce(local, group=group, async_op=True), "gradient norm reduction")
    return local.cpu().sqrt()


def clip_grad_norm_global(
    params: Iterable[torch.Tensor],
    max_norm: float,
    replicas: int,
    failure: FailureChannel | None,
    group: Any = None,
    copies: Mapping[int, int] | None = None,
) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    total = global_grad_norm(params, replicas, failure, group, copies)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in params:
        param.grad.detach().mul_(coef.to(param.grad.dtype).to(param.grad.device))
    return total
