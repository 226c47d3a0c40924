"""A loss that is a sum over the batch's rows, caught in the first training step.

Under ``loss_reduction="mean"`` the pipeline weights each micro-batch's loss by its share of
the batch's rows (``execute/stage.py``): one device's gradients exactly when the loss is a
mean over samples. A sum over rows (``F.mse_loss(..., reduction="sum")``, ``loss.sum()``)
is additive instead: the batch's loss is the sum of its parts' losses, not their mean, so
weighting the parts by their rows trains with 1/M of one device's gradients and logs the
sum divided by M, silently. The first step follows the values computed from the slice's
rows (the batch's tensors and the forward's output, through every operation the step runs
on them) and notes each sum over those rows; a sum divided by its count of rows (or of
elements) is a mean and is let go, as is a division by a tensor the data made (a token
count, which ``loss_check.py`` judges). A returned loss still carrying such a sum is
refused with ``loss_reduction="sum"`` as the fix. Sums of parameters (a weight penalty)
are not rows and pass.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError

__all__ = ["RowSums"]

_LOSSES: dict[Callable[..., Any], inspect.Signature] = {
    fn: inspect.signature(fn)
    for fn in (
        F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits,
        F.cross_entropy, F.nll_loss, F.kl_div, F.poisson_nll_loss, F.gaussian_nll_loss, F.soft_margin_loss,
        F.multilabel_soft_margin_loss, F.multilabel_margin_loss, F.multi_margin_loss, F.margin_ranking_loss,
        F.hinge_embedding_loss, F.cosine_embedding_loss, F.triplet_margin_loss,
    )
}
_SUMS = (torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum)
_DIVIDES = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide, torch.Tensor.__truediv__)
_MULTIPLIES = (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)


class RowSums:
    """The row sums of one step (module docstring). ``follow`` sees every operation the
    step runs (``LossWatch`` calls it); ``check`` judges the returned loss."""

    def __init__(self) -> None:
        self.rows: int | None = None
        self._from_rows: dict[int, torch.Tensor] = {}  # tensors computed from the slice's rows, by id
        # scalars carrying a sum over rows: id -> (the tensor, what summed, the counts that make it a mean)
        self._sums: dict[int, tuple[torch.Tensor, str, set[int]]] = {}

    def mark(self, value: Any) -> None:
        """Note the tensors in ``value`` (a batch slice, the forward's output) as rows."""
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                self._from_rows[id(leaf)] = leaf

    def follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Carry the row marks and the sums through one operation's result ``out``."""
        if not isinstance(out, torch.Tensor) or not self.rows:
            return
        leaves = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        from_rows = any(self._from_rows.get(id(a)) is a for a in leaves)
        if from_rows and out.dim() > 0:
            self._from_rows[id(out)] = out
        if not out.requires_grad:
            return
        summed = self._summed_rows(func, args, kwargs) if from_rows else None
        if summed is not None:
            self._sums[id(out)] = (out, *summed)
            return
        carried = [self._sums[id(a)] for a in leaves if id(a) in self._sums and self._sums[id(a)][0] is a]
        if not carried or out.dim() != 0:
            return
        if not self._averaged(func, args, carried[0][2]):
            self._sums[id(out)] = (out, carried[0][1], carried[0][2])

    def _summed_rows(self, func: Any, args: tuple, kwargs: dict) -> tuple[str, set[int]] | None:
        """What this call sums over the slice's rows, and the counts that would make it a
        mean; None when it sums nothing over rows."""
        rows = self.rows
        assert rows
        if func in _LOSSES:
            bound = _LOSSES[func].bind(*args, **kwargs)
            bound.apply_defaults()
            call = bound.arguments
            first = next(iter(call.values()))
            if call.get("reduction") != "sum" or not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] % rows:
                return None
            counts = {rows, first.shape[0], first.numel()}
            target = call.get("target")
            if isinstance(target, torch.Tensor):
                counts.add(target.numel())
            return f"{func.__name__}(reduction='sum')", counts
        if func in _SUMS and len(args) == 1 and not kwargs:
            summed = args[0]
            if isinstance(summed, torch.Tensor) and summed.dim() > 0 and summed.shape[0] % rows == 0:
                return "a .sum() over the rows", {rows, summed.shape[0], summed.numel()}
        return None

    @staticmethod
    def _averaged(func: Any, args: tuple, counts: set[int]) -> bool:
        """Whether this operation turns the sum into a mean: a division by its count of rows
        or elements (or a multiplication by its inverse), or by a tensor the data made."""
        if func in _DIVIDES and len(args) == 2:
            divisor = args[1]
            if isinstance(divisor, torch.Tensor):
                return True  # a count the data made (a mask's sum): loss_check.py judges it
            return isinstance(divisor, (int, float)) and divisor in counts
        if func in _MULTIPLIES and len(args) == 2:
            factor = args[1] if not isinstance(args[1], torch.Tensor) else args[0]
            return isinstance(factor, float) and factor != 0 and any(abs(factor * count - 1) < 1e-12 for count in counts)
        return False

    def check(self, loss: torch.Tensor) -> None:
        """Refuse a returned loss that is still a sum over the slice's rows."""
        found = self._sums.get(id(loss))
        self._from_rows.clear()
        self._sums.clear()
        if found is None or found[0] is not loss:
            return
        raise DappleConfigError(
            "loss_reduction",
            f"is 'mean' (each micro-batch's loss weighted by its share of the batch's rows), but training_step's loss is a "
            f"sum over the rows ({found[1]}): the batch's loss is the sum of its micro-batches' losses, not their mean, so "
            "the gradients would be a fraction of one device's",
            "pass DappleStrategy(loss_reduction='sum') for a summed loss (divided by a constant if you like), or return a "
            "mean over samples (e.g. reduction='mean', or the sum divided by len(batch))",
        )
