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
before any parameter changes, with the ways out.
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


def uneven_mean(func: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """Why this call of a watched loss is not a mean over samples, or None."""
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
    ignored = int((target == call["ignore_index"]).sum())
    if ignored:
        return f"{name} averages over the targets other than ignore_index={call['ignore_index']} ({ignored} of {target.numel()} here are ignored)"
    return None


class LossWatch(TorchFunctionMode):
    """Notes the first watched loss call that is not a mean over samples (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None and func in _WATCHED:
            self.found = uneven_mean(func, args, kwargs)
        return func(*args, **kwargs)

    def check(self) -> None:
        """Raise the reason a loss was found, with the fixes."""
        if self.found is None:
            return
        raise DappleConfigError(
            "loss_reduction",
            f"is 'mean' (each micro-batch's loss weighted by its rows), but training_step's loss is not a mean over "
            f"samples: {self.found}, a count that differs between micro-batches, so the gradients would not be those "
            "of one device on the whole batch",
            "return a mean over samples (e.g. average each sequence's token losses, then the sequences); or a sum, "
            "divided by a constant if you like, with DappleStrategy(loss_reduction='sum'); or accept each "
            "micro-batch's mean weighted by its rows, as torch.distributed.pipelining and DeepSpeed compute, with "
            "loss_reduction='micro_batch_mean'",
        )
