"""Gradient clipping by the global norm over all stages (each parameter counted once).

A pipeline rank holds only its stage's parameters; clipping by the local norm would give
each stage a different scale and break equivalence with single-device training. Each rank
contributes its squared norm divided by its stage's replica count (replicas hold equal
gradients after the AllReduce), the sum over the plan is the squared global norm, and the
clip coefficient is the one ``torch.nn.utils.clip_grad_norm_`` would use on one device.
A tied parameter held by several stages (``execute/tied.py``) has the same summed gradient
on every rank holding a copy; ``copies`` gives that rank count, and each copy contributes
its square divided by it, so the parameter counts once.

Under ZeRO (``strategy/zero.py``) the replicas of a stage own whole parameters, and only
the owner counts a parameter it owns (``shares``), with its whole square: under ZeRO-2 the
others no longer hold its gradient, and under fp16 the others' copies were never unscaled
(the GradScaler unscales what the optimizer holds, the owner's share). The sum over the
replica group is still each parameter once; a tied parameter counts on its owner as often
as its stage has replicas, so over the holders it still counts once.

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
from lightning_dapple.execute.transfer.wires import waits_on_device


def _grouped(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the gradients' squared 2-norms (float64, on ``device``)."""
    norms = [torch.stack(torch._foreach_norm(parts, 2.0)).to(device, torch.float64) for parts in _grouped(grads).values()]
    return torch.cat(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=device)


def global_grad_norm(
    grads: list[torch.Tensor],
    replicas: int,
    failure: FailureChannel | None,
    device: torch.device,
    group: Any = None,
    tied: Sequence[tuple[torch.Tensor, float]] = (),
    owned: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The 2-norm of all stages' gradients (a float64 scalar on ``device``, the rank's
    device, also when this rank has no gradient); ``grads`` are this rank's gradients that
    every replica of its stage holds, ``owned`` those only this replica counts (ZeRO's
    share), ``tied`` its tied parameters' gradients with what each square is divided by
    (the number of ranks holding it)."""
    local = _squares(grads, device) / replicas
    if owned:
        local = local + _squares(list(owned), device)
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
    shares: Mapping[int, bool] | None = None,
) -> torch.Tensor:
    """Scale every gradient by ``min(1, max_norm / (global norm + 1e-6))`` and return the
    global norm (on ``device``: the rank's device; default: where its parameters live).
    ``copies``: id(tied parameter) -> the ranks holding its gradient (``TiedSync.copies``);
    ``shares``: under ZeRO, id(parameter) -> whether this replica owns it, for every
    parameter one replica of the stage owns (module docstring)."""
    params = list(params)
    if device is None:
        device = params[0].device if params else torch.device("cpu")
    grads = [p.grad.detach() for p in params if p.grad is not None]
    shared, owners = copies or {}, shares or {}
    whole: list[torch.Tensor] = []
    owned: list[torch.Tensor] = []
    tied: list[tuple[torch.Tensor, float]] = []
    for p in params:
        mine = owners.get(id(p))
        if p.grad is None or mine is False:  # another replica counts it
            continue
        if id(p) in shared:
            tied.append((p.grad.detach(), shared[id(p)] / replicas if mine else shared[id(p)]))
        else:
            (owned if mine else whole).append(p.grad.detach())
    total = global_grad_norm(whole, replicas, failure, device, group, tied, owned)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (where, dtype), parts in _grouped(grads).items():
        torch._foreach_mul_(parts, coef.to(where, dtype))
    return total
