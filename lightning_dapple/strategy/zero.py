"""Optimizer state sharded over a replicated stage's replicas (ZeRO stage 1).

DAPPLE replicates a stage on several devices and keeps the replicas equal by summing their
gradients every step (DAPPLE 5.2.3); each replica then runs the same optimizer step on the
same values, and holds the same optimizer state: Adam's two moments, twice the stage's
weights, on every replica. With ``DappleStrategy(zero=1)`` each replica keeps the state of
its own share of the stage's parameters only, as DeepSpeed's ZeRO-1 and Megatron's
distributed optimizer do inside a data-parallel group:

* the shares are whole parameters, assigned once per plan, largest first, each to the
  replica holding the fewest elements so far (so the shares differ by at most one
  parameter's size), the same on every replica;
* the user's optimizer (``configure_optimizers``) keeps every parameter group, with only
  the replica's own parameters in them, before its first step, so it never makes state
  for the others (learning-rate schedulers and group settings are untouched);
* the gradients are summed as before (every replica holds the stage's whole gradient), so
  clipping by the global norm sees every parameter once (``complete``);
* after each optimizer step every replica sends the parameters it stepped to the others
  (one broadcast per owner and dtype over the stage's replica group), so all replicas hold
  the values one device would: an element-wise optimizer (SGD, Adam, AdamW, ...) computes
  the same numbers on the owner as it would on each replica.

Checkpoints gather each replica's share of the state (``CheckpointLayout.optimizer_ranks``)
and load back by parameter name, under any plan.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ZeroShards", "assign_owners"]


def assign_owners(params: Sequence[torch.Tensor], replicas: int) -> list[int]:
    """The replica (index into the stage's devices) that keeps each parameter's state:
    largest first, to the replica with the fewest elements so far (ties: the lowest index)."""
    loads = [0] * replicas
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner = min(range(replicas), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += params[index].numel()
    return owners


class ZeroShards:
    """This rank's share of its stage's optimizer state, and the broadcasts that keep the
    replicas equal (module docstring)."""

    def __init__(self, devices: Sequence[int], rank: int, group: Any, wait: Callable[[Any, str], None]) -> None:
        self.devices = tuple(devices)  # the stage's replicas' global ranks, in the plan's order
        self.index = self.devices.index(rank)
        self.group = group
        self.wait = wait  # the failure channel's bounded wait
        self._full: dict[int, list[torch.Tensor]] = {}  # id(optimizer) -> its parameters before sharding
        self._owners: dict[int, int] = {}  # id(parameter) -> owning replica index

    def shard(self, optimizers: Sequence[Any]) -> None:
        """Keep in each optimizer only this replica's parameters (before any state exists)."""
        params = list({id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}.values())
        self._owners = {id(p): owner for p, owner in zip(params, assign_owners(params, len(self.devices)))}
        for optimizer in optimizers:
            self._full[id(optimizer)] = [p for group in optimizer.param_groups for p in group["params"]]
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if self._owners.get(id(p), self.index) == self.index]

    def complete(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` (an optimizer's, sharded) with the parameters sharding took out of that
        optimizer: what clipping by the global norm must see."""
        mine = {id(p) for p in params}
        for full in self._full.values():
            if any(id(p) in mine for p in full):
                return list({id(p): p for p in (*params, *full)}.values())
        return list(params)

    @torch.no_grad()
    def share(self, optimizer: Any) -> None:
        """After ``optimizer`` stepped: each owner's parameters go to the other replicas, and
        the gradients of the parameters this replica does not step are cleared (Lightning's
        ``zero_grad`` reaches only the optimizer's own)."""
        full = self._full.get(id(optimizer))
        if not full:
            return
        for p in full:
            if self._owners.get(id(p)) != self.index:
                p.grad = None
        for owner, rank in enumerate(self.devices):
            by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in full:
                if self._owners.get(id(p)) == owner:
                    by_dtype.setdefault((p.dtype, p.device), []).append(p)
            for params in by_dtype.values():
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                work = dist.broadcast(flat, src=rank, group=self.group, async_op=True)
                self.wait(work, f"the parameters replica {owner} of the stage stepped (ZeRO-1)")
                if owner != self.index:
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
