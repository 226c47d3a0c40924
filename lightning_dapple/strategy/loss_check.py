"""Losses that are not a mean over samples, caught in the first training step.

A pipeline computes each micro-batch's loss on its own and weights it by the micro-batch's
share of the batch's rows (``loss_reduction="mean"``, ``execute/stage.py``). That gives the
gradients of one device on the whole batch exactly when the loss is a mean over samples.
``cross_entropy`` and ``nll_loss`` with their default ``reduction="mean"`` are a mean over
*targets*, weighted by class ``weight`` where one is given and leaving out the targets equal
to ``ignore_index`` (the -100 labels of padded tokens in language modelling): the count they
divide by differs between micro-batches, so the row-weighted mean of the micro-batch losses
is another number than the batch's loss, and training would go on silently wrong.
``torch.distributed.pipelining`` and DeepSpeed's pipeline engine average micro-batch losses
the same way and say nothing; here the first training step watches the user's loss
computation (a ``TorchFunctionMode``, observing only) and a loss of that kind stops the run
before any parameter changes, with the ways out. Not refused: ignored targets in equal
numbers in every row (then each micro-batch's count is proportional to its rows), a call the
returned loss does not depend on (a logged perplexity), and an uncut batch (M = 1 on one
last-stage replica: the strategy does not watch).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_dapple.errors import DappleConfigError

__all__ = ["LossWatch", "uneven_mean"]

# the losses whose mean divides by a count of targets that depends on the targets
_WATCHED: dict[Callable[..., Any], inspect.Signature] = {fn: inspect.signature(fn) for fn in (F.cross_entropy, F.nll_loss)}


def uneven_mean(func: Callable[..., Any], args: tuple, kwargs: dict, rows: int | None = None, per_row: set[int] | None = None) -> str | None:
    """Why this call of a watched loss is not a mean over samples, or None.

    With ``rows`` (the slice's) ignored targets are fine where every row keeps the same
    number of targets, in this call and in the step's others (``per_row`` collects it):
    each micro-batch's count is then proportional to its rows (a causal LM's shifted labels,
    one -100 per row, in batches of one length)."""
    bound = _WATCHED[func].bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    if call["reduction"] != "mean" or call["size_average"] is not None or call["reduce"] is not None:
        return None
    target = call["target"]
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # class probabilities: a mean over samples
    name = func.__name__
    if call["weight"] is not None:
        return f"{name}(weight=...) divides by the summed class weights of the batch's targets"
    kept = target != call["ignore_index"]
    ignored = int(target.numel() - kept.sum())
    if not ignored:
        return None
    if rows and per_row is not None and target.numel() % rows == 0:
        counts = set(kept.reshape(rows, -1).sum(1).tolist())
        per_row.update(counts)
        if len(per_row) == 1:
            return None
    return f"{name} averages over the targets other than ignore_index={call['ignore_index']} ({ignored} of {target.numel()} here are ignored, a number that differs between rows)"


class LossWatch(TorchFunctionMode):
    """Notes the watched loss calls that are not a mean over samples (module docstring); only
    those the returned loss depends on count (``check``): a masked perplexity computed for a
    log does not."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, Any]] = []  # (why, the call's grad_fn)
        self.rows: int | None = None  # the current slice's rows (``watching``)
        self._per_row: set[int] = set()  # kept targets per row, over the step's calls

    def watching(self, rows: int) -> "LossWatch":
        """This watch, for one slice of ``rows`` rows (``with watch.watching(rows):``)."""
        self.rows = rows
        return self

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _WATCHED:
            why = uneven_mean(func, args, kwargs, self.rows, self._per_row)
            if why is not None:
                self.found.append((why, out.grad_fn if isinstance(out, torch.Tensor) else None))
        return out

    def check(self, loss: torch.Tensor) -> None:
        """Raise the reason a loss ``loss`` depends on was found, with the fixes."""
        feeding = [why for why, grad_fn in self.found if grad_fn is not None and _reaches(loss.grad_fn, grad_fn)]
        self.found = []
        if not feeding:
            return
        raise DappleConfigError(
            "loss_reduction",
            f"is 'mean' (each micro-batch's loss weighted by its rows), but training_step's loss is not a mean over "
            f"samples: {feeding[0]}, a count that differs between micro-batches, so the gradients would not be those "
            "of one device on the whole batch",
            "return a mean over samples (e.g. average each sequence's token losses, then the sequences); or a sum, "
            "divided by a constant if you like, with DappleStrategy(loss_reduction='sum'); or accept each "
            "micro-batch's mean weighted by its rows, as torch.distributed.pipelining and DeepSpeed compute, with "
            "loss_reduction='micro_batch_mean'",
        )


def _reaches(start: Any, target: Any) -> bool:
    """Whether autograd node ``target`` is ``start`` or lies behind it."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if node is target:
            return True
        seen.add(id(node))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False
