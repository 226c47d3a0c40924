"""Losses that are not a mean over samples, caught in the first training step.

A pipeline computes each micro-batch's loss on its own and weights it by the micro-batch's
share of the batch's rows (``loss_reduction="mean"``, ``execute/stage.py``). That gives the
gradients of one device on the whole batch exactly when the loss is a mean over samples.
``cross_entropy`` and ``nll_loss`` with their default ``reduction="mean"`` are a mean over
*targets*, weighted by class ``weight`` where one is given and leaving out the targets equal
to ``ignore_index`` (the -100 labels of padded tokens in language modelling): the count they
divide by differs between micro-batches, so the row-weighted mean of the micro-batch losses
is another number than the batch's loss, and training would go on silently wrong. The
same holds for a token mean written by hand over a padding mask: a division by the mask's
sum (``(loss * mask).sum() / mask.sum()``) or a mean of what a boolean mask selected
(``loss[mask].mean()``, ``cross_entropy(logits[mask], labels[mask])``), when the mask
keeps other numbers of targets in different rows.
``torch.distributed.pipelining`` and DeepSpeed's pipeline engine average micro-batch losses
the same way and say nothing; here the first training step watches the user's loss
computation (a ``TorchFunctionMode``, observing only) and a loss of that kind stops the run
before any parameter changes, with the ways out. Not refused: ignored targets in equal
numbers in every row (then each micro-batch's count is proportional to its rows), a call the
returned loss does not depend on (a logged perplexity), and an uncut batch (M = 1 on one
last-stage replica: the strategy does not watch). The same watch refuses a loss that is a
sum over the rows (``loss_sum.py``).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy.loss_sum import RowSums

__all__ = ["LossWatch", "uneven_mean"]

# the losses whose mean divides by a count of targets that depends on the targets
_WATCHED: dict[Callable[..., Any], inspect.Signature] = {fn: inspect.signature(fn) for fn in (F.cross_entropy, F.nll_loss)}
# a token mean written by hand: (loss * mask).sum() / mask.sum(), or loss[mask].mean()
_COUNTS = (torch.sum, torch.Tensor.sum, torch.count_nonzero, torch.Tensor.count_nonzero)
_DIVIDES = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.true_divide, torch.Tensor.__truediv__)
_MEANS = (torch.mean, torch.Tensor.mean)


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
        # per-row counts of the step's masks: a mask's full sum (a divisor) and what a
        # boolean mask selected, keyed by the tensor's id (the tensor kept alive beside them)
        self._counts: dict[int, tuple[torch.Tensor, list[float]]] = {}
        self._selected: dict[int, tuple[torch.Tensor, list[float]]] = {}
        self._mask_rows: set[float] = set()  # the masks' per-row counts, over the step's calls
        self.row_sums = RowSums()  # sums over the rows (loss_sum.py)

    def watching(self, rows: int, batch: Any = None) -> "LossWatch":
        """This watch, for one slice of ``rows`` rows and its ``batch``
        (``with watch.watching(rows, batch):``)."""
        self.rows = self.row_sums.rows = rows
        self.row_sums.mark(batch)
        return self

    def marking(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward``, whose outputs count as the slice's rows (``loss_sum.py``)."""

        def marked(*args: Any) -> Any:
            out = forward(*args)
            self.row_sums.mark(out)
            return out

        return marked

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _WATCHED:
            why = uneven_mean(func, args, kwargs, self.rows, self._per_row)
            if why is None:
                why = self._selected_targets(func, args, kwargs)
            if why is not None:
                self.found.append((why, out.grad_fn if isinstance(out, torch.Tensor) else None))
        elif isinstance(out, torch.Tensor) and self.rows:
            self._follow_masks(func, args, kwargs, out)
        self.row_sums.follow(func, args, kwargs, out)
        return out

    def _follow_masks(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        """Note a mask's count (a full sum of a per-row tensor without gradient, and what is
        computed from it alone), what a boolean mask selects, and a mean over either."""
        first = args[0] if args else None
        if func in _COUNTS and len(args) == 1 and not kwargs and isinstance(first, torch.Tensor) and not first.requires_grad:
            counts = _row_counts(first, self.rows)
            if counts is not None:
                self._counts[id(out)] = (out, counts)
            return
        if func is torch.Tensor.__getitem__ and len(args) == 2 and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            counts = _row_counts(args[1], self.rows)
            if counts is not None:
                self._selected[id(out)] = (out, counts)
            return
        if func in _DIVIDES and len(args) == 2 and out.requires_grad and id(args[1]) in self._counts:
            self._uneven("divides by the sum of a mask", self._counts[id(args[1])][1], out)
        elif func in _MEANS and len(args) == 1 and not kwargs and out.requires_grad and id(first) in self._selected:
            self._uneven("averages what a boolean mask selects", self._selected[id(first)][1], out)
        elif out.dim() == 0 and not out.requires_grad:  # mask.sum().clamp(min=1), .float(), + eps
            known = [self._counts[id(a)] for a in args if isinstance(a, torch.Tensor) and id(a) in self._counts]
            if known:
                self._counts[id(out)] = (out, known[0][1])

    def _selected_targets(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """A mean watched loss over the targets a boolean mask selected (logits[mask], labels[mask])."""
        bound = _WATCHED[func].bind(*args, **kwargs)
        bound.apply_defaults()
        target = bound.arguments["target"]
        if bound.arguments["reduction"] != "mean" or not isinstance(target, torch.Tensor) or id(target) not in self._selected:
            return None
        return self._uneven_reason(f"{func.__name__} averages over the targets a boolean mask selected", self._selected[id(target)][1])

    def _uneven(self, what: str, counts: list[float], out: torch.Tensor) -> None:
        why = self._uneven_reason(f"the loss {what} (a token mean)", counts)
        if why is not None:
            self.found.append((why, out.grad_fn))

    def _uneven_reason(self, what: str, counts: list[float]) -> str | None:
        """Why a mean over a mask's targets is not a mean over samples: its count per row
        differs between rows (here or in the step's other slices), or None."""
        self._mask_rows.update(counts)
        if len(self._mask_rows) == 1:
            return None
        return f"{what}, whose count of targets differs between rows"

    def check(self, loss: torch.Tensor) -> None:
        """Raise the reason a loss ``loss`` depends on was found, with the fixes."""
        feeding = [why for why, grad_fn in self.found if grad_fn is not None and _reaches(loss.grad_fn, grad_fn)]
        self.found = []
        self.row_sums.check(loss)
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


def _row_counts(mask: torch.Tensor, rows: int | None) -> list[float] | None:
    """The per-row sums of ``mask``, whose first dimension is the slice's ``rows`` or, for
    a flattened one (rows x tokens), a multiple of them; None for any other tensor."""
    if not rows or mask.dim() == 0 or mask.shape[0] % rows or mask.is_complex():
        return None
    return mask.reshape(rows, -1).to(torch.float64).sum(1).tolist()


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
