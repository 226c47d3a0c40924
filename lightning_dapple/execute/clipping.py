"""Gradient clipping by the global norm over all stages (each parameter counted once).

A pipeline rank holds only its stage's parameters; clipping by the local norm would give
each stage a different scale and break equivalence with single-device training. Each rank
contributes its squared norm divided by its stage's replica count (replicas hold equal
gradients after the AllReduce), the sum over the plan is the squared global norm, and the
clip coefficient is the one ``torch.nn.utils.clip_grad_norm_`` would use on one device.
A tied parameter held by several stages (``execute/tied.py``) has the same summed gradient
on every rank holding a copy; ``copies`` gives that rank count, and each copy contributes
its square divided by it, so the parameter counts once.

Computed as torch computes it: one ``_foreach_norm`` per (device, dtype) group of
gradients and one ``_foreach_mul_`` to scale them, with every intermediate on the device.
Nothing is read on the host; a gloo process group reduces the one squared norm through
the host (gloo reduces host tensors), NCCL on the device, where the compute stream (not
the host) waits for it.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import collective_device
from lightning_dapple.execute.wires import waits_on_device


def _grouped(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def global_grad_norm(
    grads: list[torch.Tensor],
    replicas: int,
    failure: FailureChannel | None,
    device: torch.device,
    group: Any = None,
    tied: Sequence[tuple[torch.Tensor, int]] = (),
) -> torch.Tensor:
    """The 2-norm of all stages' gradients (a float64 scalar on ``device``, the rank's
    device, also when this rank has no gradient); ``grads`` are this rank's, ``tied`` its
    tied parameters' gradients with the number of ranks holding each."""
    norms = [torch.stack(torch._foreach_norm(parts, 2.0)).to(device, torch.float64) for parts in _grouped(grads).values()]
    local = torch.cat(norms).square().sum() / replicas if norms else torch.zeros((), dtype=torch.float64, device=device)
    for grad, holders in tied:  # a tied parameter: every copy holds the whole gradient
        local = local + torch.linalg.vector_norm(grad, 2.0).to(device, torch.float64).square() / holders
    if failure is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        carrier = local.to(collective_device(group, device))
        work = dist.all_reduce(carrier, group=group, async_op=True)
        if waits_on_device(device, group):  # NCCL: the stream waits, the watchdog bounds it
            failure.wait_on_device([work], "gradient norm reduction", carrier.device.index)
        else:
            failure.wait(work, "gradient norm reduction")
        local = carrier.to(device, non_blocking=True)
    return local.sqrt()


def clip_grad_norm_global(
    params: Iterable[torch.Tensor],
    max_norm: float,
    replicas: int,
    failure: FailureChannel | None,
    group: Any = None,
    device: torch.device | None = None,
    copies: Mapping[int, int] | None = None,
) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (global norm + 1e-6))`` and return the
    global norm (on ``device``: the rank's device; default: where its parameters live).
    ``copies``: id(tied parameter) -> the ranks holding its gradient (``TiedSync.copies``)."""
    params = list(params)
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    grads = [p.grad.detach() for p in params if p.grad is not None]
    shared = copies or {}
    tied = [(p.grad.detach(), shared[id(p)]) for p in params if p.grad is not None and id(p) in shared]
    own = [p.grad.detach() for p in params if p.grad is not None and id(p) not in shared] if shared else grads
    total = global_grad_norm(own, replicas, failure, device, group, tied)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (where, dtype), parts in _grouped(grads).items():
        torch._foreach_mul_(parts, coef.to(where, dtype))
    return total
