"""Checks of every training batch before its step and of its loss before the update.

A pipeline spreads one bad batch into errors far from their cause: a batch of the wrong
width fails inside some layer of stage 0 ("mat1 and mat2 shapes cannot be multiplied")
while the other stages only learn that stage 0 failed; a batch too short for the plan's
micro-batches x replicas (DAPPLE 5.2.2 slices every micro-batch over a stage's replicas)
fails in the slicing; a NaN loss is not an error at all and silently turns every
parameter into NaN at the optimizer step, and the next checkpoint with it.

Every rank iterates the same global batches (the strategy gives each rank the whole
batch) and every rank receives the global loss, so these checks give the same answer on
every rank: all ranks raise the same one-line error at the same point, before any
communication of the step (batch) or before the optimizer changes anything (loss), and
nothing is left half done -- the last good checkpoint stays the last.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.slicing import batch_size_of


class NonFiniteLossError(DappleConfigError):
    """The loss of a training step is NaN or infinite; nothing was updated. Bad data (or
    settings) like a malformed batch, and reported the same way: once, on one line."""


class LeafSpec(NamedTuple):
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # without the batch dimension


def _leaves(batch: Any) -> tuple[list[LeafSpec], Any]:
    flat, spec = pytree.tree_flatten_with_path(batch)
    leaves = [
        LeafSpec(pytree.keystr(path) or "batch", leaf.dtype, tuple(leaf.shape[1:]))
        for path, leaf in flat
        if isinstance(leaf, torch.Tensor)
    ]
    return leaves, spec


# per strategy: the layout of the first training batch, which every later batch must share
_first_batches: "weakref.WeakKeyDictionary[Any, tuple[list[LeafSpec], Any]]" = weakref.WeakKeyDictionary()


def _where(step: int, batch_idx: int) -> str:
    return f"training step {step} (batch {batch_idx} of the epoch)"


def check_training_batch(strategy: Any, batch: Any, batch_idx: int) -> None:
    """Raise ``DappleConfigError`` naming the step if ``batch`` cannot run under the plan:
    a layout (structure, dtype, per-sample shape) other than the first batch's, or more
    rows than the global batch, or fewer than the plan's micro-batches x replicas."""
    plan = strategy.plan
    step = int(strategy.lightning_module.trainer.global_step)
    where = _where(step, batch_idx)
    leaves, spec = _leaves(batch)
    first = _first_batches.setdefault(strategy, (leaves, spec))
    if spec != first[1]:
        raise DappleConfigError(
            f"batch of {where}", f"has the structure {spec}, the first batch had {first[1]}", "make every batch of the DataLoader the same structure"
        )
    for got, expected in zip(leaves, first[0]):
        if got != expected:
            raise DappleConfigError(
                f"batch of {where}",
                f"has {got.path} of dtype {got.dtype} and per-sample shape {list(got.shape)}, "
                f"the first batch had {expected.dtype} and {list(expected.shape)}",
                f"make every batch's {got.path} {expected.dtype} with per-sample shape {list(expected.shape)} (check the dataset and collate_fn)",
            )
    rows = batch_size_of(batch)
    widest = max(stage.replicas for stage in plan.stages)
    if rows < plan.micro_batches * widest:
        raise DappleConfigError(
            f"batch of {where}",
            f"has {rows} samples, fewer than the plan's {plan.micro_batches} micro-batches x {widest} replicas",
            f"use DataLoader(drop_last=True), or a dataset whose size is a multiple of the global batch {plan.global_batch_size}",
        )
    if rows > plan.global_batch_size:
        raise DappleConfigError(
            f"batch of {where}",
            f"has {rows} samples, more than the plan's global batch of {plan.global_batch_size}",
            "give every batch the DataLoader batch size the plan was made for",
        )


def check_training_loss(strategy: Any, loss: torch.Tensor, batch_idx: int) -> None:
    """Raise ``NonFiniteLossError`` naming the step if the step's global loss is NaN/inf
    (before the optimizer step, so no parameter and no checkpoint takes it in)."""
    value = float(loss.detach())
    if math.isfinite(value):
        return
    step = int(strategy.lightning_module.trainer.global_step)
    raise NonFiniteLossError(
        f"loss of {_where(step, batch_idx)}",
        f"is {value}; no parameter was updated",
        "check that batch for NaN/inf values, lower the learning rate, or clip gradients (Trainer(gradient_clip_val=...))",
    )
