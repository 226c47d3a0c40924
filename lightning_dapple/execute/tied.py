"""Gradients of tied parameters held by several stages: one sum over every copy.

A parameter used by layers on different stages (a token embedding that is also the output
projection) lives on each of those stages as its own ``nn.Parameter`` with equal values
(``strategy/tied_layers.py``). After the step's backward each copy holds only the
contributions of its own stage's uses on its own replica's rows. Single-device training
would give the sum over every use and every row, so:

* these parameters stay out of the stages' replica buckets (``execute/grad_sync.py``,
  DAPPLE 5.2.3), and
* one AllReduce (sum) over the union of the ranks of every stage holding a copy adds all
  the partial gradients: each rank's gradient is then the full one, once.

This is Megatron's embedding group generalised to stages of any replica count (Megatron
sums over stage replicas first and then pairs the first and last stage's ranks, which
needs equal replica counts). Every copy receives the same reduced tensor, the optimizer
state of every copy starts equal (loaded from one checkpoint entry, or initialised from
equal values), and gradient clipping uses one global coefficient, so the copies stay
bit-identical step after step. The AllReduce runs after the stage's own buckets at the
end of the step (the simulator prices it there: ``StageCost.tied``).

Stages on the same devices (a V schedule's first and last stage, holding a tied embedding
and head) run in one process, where their layers keep the model's own single
``nn.Parameter``: autograd adds both stages' uses into its ``.grad``, so the rank holds one
copy with its whole local part, and the sum over ranks counts every use once.

Ties are grouped by the set of ranks holding them; each group is one flat AllReduce on a
process group of its own, made by every rank in the same order (``tied_groups``).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dapple.errors import require
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.grad_sync import FlatBucket
from lightning_dapple.execute.process_groups import subgroup
from lightning_dapple.plan.costs import stages_holding
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.ties import TiedParameter

__all__ = ["TiedSync", "split_ties", "tied_groups", "build_tied_sync"]


def split_ties(plan: Plan, ties: Sequence[TiedParameter]) -> list[tuple[TiedParameter, tuple[int, ...]]]:
    """The ties ``plan`` puts on more than one stage, with the stages holding each."""
    out = []
    for tie in ties:
        holders = stages_holding(tie.layers, plan.stages)
        if len(holders) > 1:
            out.append((tie, holders))
    return out


def _ranks(plan: Plan, holders: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted({rank for s in holders for rank in plan.stages[s].devices}))


def tied_groups(plan: Plan, ties: Sequence[TiedParameter], backend: str | None = None) -> dict[tuple[int, ...], Any]:
    """A process group per set of ranks sharing tied parameters (keyed by those ranks).

    ``new_group`` is a collective of the whole default group: every rank calls this with
    the same plan and ties, and the groups are made in the same order everywhere."""
    groups: dict[tuple[int, ...], Any] = {}
    for _, holders in split_ties(plan, ties):
        ranks = _ranks(plan, holders)
        if ranks not in groups:
            groups[ranks] = subgroup(list(ranks), backend=backend)
    return groups


class TiedSync:
    """Sums this rank's tied copies' gradients over every rank holding one (module docstring)."""

    def __init__(self, buckets: Sequence[tuple[Sequence[nn.Parameter], Any, int]], failure: FailureChannel) -> None:
        self.failure = failure
        self._buckets = [(FlatBucket(list(params), group), group, copies) for params, group, copies in buckets if params]
        # the local copies of tied parameters (kept out of the stage's replica buckets)
        self.params: list[nn.Parameter] = [p for bucket, _, _ in self._buckets for p in bucket.params]
        # id(parameter) -> how many ranks hold its summed gradient (gradient clipping counts
        # a tied parameter once: each copy contributes 1/copies of its square)
        self.copies: dict[int, int] = {id(p): copies for bucket, _, copies in self._buckets for p in bucket.params}

    def finish(self) -> None:
        """Launch every tied AllReduce, wait for them and put the sums into ``.grad``."""
        for bucket, group, _ in self._buckets:
            bucket.launch(group)
        for bucket, _, _ in self._buckets:
            bucket.finish(self.failure, "AllReduce of tied parameters")


def build_tied_sync(
    plan: Plan,
    ties: Sequence[TiedParameter],
    rank: int,
    layers: Sequence[nn.Module],
    groups: dict[tuple[int, ...], Any],
    failure: FailureChannel,
) -> TiedSync | None:
    """This rank's ``TiedSync`` (None when its stages share no parameter with another).

    ``layers`` are the rank's layers (its stages' ranges, in pipeline order); each tie's
    local copy is found by its name in each of its layers here. Where several of this rank's
    stages hold the tie they must share that one ``nn.Parameter`` (module docstring):
    separate copies would each sum only their own part, so they are refused."""
    held = plan.stages_of_rank(rank)
    offsets = dict(zip(held, itertools.accumulate((plan.stages[s].end - plan.stages[s].start for s in held), initial=0)))
    by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for tie, holders in split_ties(plan, ties):
        local = [
            layers[offsets[s] + layer - plan.stages[s].start].get_parameter(tie.name_in(layer))
            for s in holders
            if s in offsets
            for layer in tie.layers
            if plan.stages[s].start <= layer < plan.stages[s].end
        ]
        if not local:
            continue
        param = local[0]
        require(
            all(other is param for other in local),
            "model",
            f"holds separate tensors for the tied parameter {tie.name_in(tie.owner)!r} in layers {list(tie.layers)} on rank {rank}",
            "keep the layers' shared nn.Parameter (do not copy or re-create it after the model is built)",
        )
        if param.requires_grad:
            by_ranks.setdefault(_ranks(plan, holders), []).append(param)
    if not by_ranks:
        return None
    return TiedSync([(params, groups[ranks], len(ranks)) for ranks, params in by_ranks.items()], failure)
