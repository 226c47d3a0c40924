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

Ties are grouped by the set of stages holding them; each group is one flat AllReduce on a
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
from lightning_dapple.plan.costs import stages_holding
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.ties import TiedParameter

__all__ = ["TiedSync", "split_ties", "tied_groups", "build_tied_sync", "check_ties_on_groups"]


def split_ties(plan: Plan, ties: Sequence[TiedParameter]) -> list[tuple[TiedParameter, tuple[int, ...]]]:
    """The ties ``plan`` puts on more than one stage, with the stages holding each."""
    out = []
    for tie in ties:
        holders = stages_holding(tie.layers, plan.stages)
        if len(holders) > 1:
            out.append((tie, holders))
    return out


def check_ties_on_groups(plan: Plan, ties: Sequence[TiedParameter]) -> None:
    """Refuse a tie held by two stages on the same devices (on every rank alike, before
    training): each would keep a copy on those ranks and the sum would count its own part only."""
    placement = plan.placement
    for tie, holders in split_ties(plan, ties):
        groups = [placement[index] for index in holders]
        shared = sorted({index for index in holders if groups.count(placement[index]) > 1})
        require(
            not shared,
            "plan.stages[].devices",
            f"stages {shared} share the tied parameter {tie.name_in(tie.owner)!r} of layers {list(tie.layers)} and run on the same devices",
            "place the stages using a tied parameter on different device groups (e.g. schedule 'interleaved' instead of 'zbv'), or untie it",
        )


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
            groups[ranks] = dist.new_group(list(ranks), backend=backend)
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
    local copy is found by its name in the first of its layers on this rank's stage. Two
    stages on this rank holding one tie (a V schedule's first and last stage, with a tied
    embedding and head) are refused: each would hold a copy here and sum only its own part."""
    check_ties_on_groups(plan, ties)
    held = plan.stages_of_rank(rank)
    offsets = dict(zip(held, itertools.accumulate((plan.stages[s].end - plan.stages[s].start for s in held), initial=0)))
    by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for tie, holders in split_ties(plan, ties):
        mine = [index for index in holders if index in offsets]
        if not mine:
            continue
        stage = plan.stages[mine[0]]
        layer = next(index for index in tie.layers if stage.start <= index < stage.end)
        param = layers[offsets[mine[0]] + layer - stage.start].get_parameter(tie.name_in(layer))
        if param.requires_grad:
            by_ranks.setdefault(_ranks(plan, holders), []).append(param)
    if not by_ranks:
        return None
    return TiedSync([(params, groups[ranks], len(ranks)) for ranks, params in by_ranks.items()], failure)
