"""Optimizer state and gradients sharded over a replicated stage's replicas (ZeRO-1 and -2).

DAPPLE replicates a stage on several devices and keeps the replicas equal by summing their
gradients every step (DAPPLE 5.2.3); each replica then runs the same optimizer step on the
same values, and holds the same optimizer state: Adam's two moments, twice the stage's
weights, on every replica. With ``DappleStrategy(zero=1)`` each replica keeps the state of
its own share of the stage's parameters only, as DeepSpeed's ZeRO-1 and Megatron's
distributed optimizer do inside a data-parallel group; ``zero=2`` also keeps only that
share's gradients (ZeRO-2):

* the shares are whole parameters, assigned once per plan, largest first, each to the
  replica holding the fewest elements so far (so the shares differ by at most one
  parameter's size), the same on every replica;
* the user's optimizer (``configure_optimizers``) keeps every parameter group, with only
  the replica's own parameters in them, before its first step, so it never makes state
  for the others (learning-rate schedulers and group settings are untouched);
* ``zero=1`` sums the gradients as before (every replica holds the stage's whole
  gradient until the step); ``zero=2`` reduces each gradient bucket to the owners of its
  parameters instead (``execute/grad_sync.py``: one reduction per owner and bucket, from
  the same backward hooks, so it overlaps the backward as the sum does), and every replica
  drops the gradients it does not own, so it holds its share of them between the backward
  and the step. Parameters tied to another stage keep their whole gradient on every
  replica: their sum spans stages (``execute/tied.py``);
* clipping by the global norm sees every parameter once: each owner counts its share,
  and the sum runs over every rank of the plan (``execute/clipping.py``, ``shares``);
* after each optimizer step every replica sends the parameters it stepped to the others
  (one broadcast per owner and dtype over the stage's replica group), so all replicas hold
  the values one device would: an element-wise optimizer (SGD, Adam, AdamW, ...) computes
  the same numbers on the owner as it would on each replica.

Precision: there are no master weights to shard. ``bf16-mixed`` and ``16-mixed`` keep the
parameters themselves in float32 (Lightning's ``MixedPrecision`` autocasts each op; no
low-precision copy of the weights outlives an op), and ``bf16-true``/``16-true`` hold them
in half precision with no float32 copy at all; the optimizer state and gradients, which
are sharded, are of the parameters' dtype. Sharding the parameters themselves would be
ZeRO-3, which a stage that runs whole layers does not do. Under ``16-mixed`` the
GradScaler unscales and checks the optimizer's parameters, the owner's share; the
inf/nan check is agreed over the plan (``precision.py``), and clipping counts each
parameter on its owner, whose gradient is the unscaled one.

Checkpoints gather each replica's share of the state (``CheckpointLayout.optimizer_ranks``)
and load back by parameter name, under any plan; gradients are not saved (a step's
gradients live within the step).
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
    """This rank's share of its stage's optimizer state (and, at ``level`` 2, of its
    gradients), and the broadcasts that keep the replicas equal (module docstring)."""

    def __init__(self, devices: Sequence[int], rank: int, group: Any, wait: Callable[[Any, str], None], level: int = 1) -> None:
        self.devices = tuple(devices)  # the stage's replicas' global ranks, in the plan's order
        self.index = self.devices.index(rank)
        self.rank = rank
        self.group = group
        self.wait = wait  # the failure channel's bounded wait
        self.level = level  # 1: optimizer state; 2: also gradients
        self._full: dict[int, list[torch.Tensor]] = {}  # id(optimizer) -> its parameters before sharding
        self._owners: dict[int, int] = {}  # id(parameter) -> owning replica index
        self._owner_ranks: dict[int, int] = {}  # id(parameter) -> owning replica's global rank
        self.shares: dict[int, bool] = {}  # id(parameter) -> whether this replica owns it (clipping)

    def shard(self, optimizers: Sequence[Any]) -> None:
        """Keep in each optimizer only this replica's parameters (before any state exists)."""
        params = list({id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}.values())
        self._owners = {id(p): owner for p, owner in zip(params, assign_owners(params, len(self.devices)))}
        self._owner_ranks = {key: self.devices[owner] for key, owner in self._owners.items()}
        self.shares = {key: owner == self.index for key, owner in self._owners.items()}
        for optimizer in optimizers:
            self._full[id(optimizer)] = [p for group in optimizer.param_groups for p in group["params"]]
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if self._owners.get(id(p), self.index) == self.index]

    def route_gradients(self, runner: Any) -> None:
        """At ``level`` 2: the runner's gradient buckets (a ``StageRunner``'s, or each chunk's
        of a ``ChunkedRunner``) reduce to the owners. Called before every step, as the
        runner rebuilds its buckets when layers are frozen or unfrozen."""
        if self.level < 2:
            return
        for unit in getattr(runner, "units", None) or [runner]:
            sync = unit.sync
            if sync is not None and sync.owners is not self._owner_ranks:
                sync.reduce_to_owners(self._owner_ranks, self.rank)

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
        ``zero_grad`` reaches only the optimizer's own; at level 2 only tied ones are left)."""
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
                self.wait(work, f"the parameters replica {owner} of the stage stepped (ZeRO-{self.level})")
                if owner != self.index:
                    offset = 0
                    for p in params:
                        p.copy_(flat[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
