"""The callbacks the runner calls into the user's step functions, and what the step hands back.

The executor runs a step's forward as stages; the user's ``training_step`` (or validation,
test, predict step) still computes the input on the first stage and the loss on the last
(``module_adapter.py``). These objects carry one step's context into those calls.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils import _pytree as pytree

from lightning_dapple.errors import require
from lightning_dapple.execute.slicing import batch_size_of
from lightning_dapple.strategy.loss_check import LossWatch
from lightning_dapple.strategy.module_adapter import (
    LogRecorder,
    Logs,
    capture_call,
    capture_input,
    combine_logged,
    forward_replaced,
    loss_of,
)
from lightning_dapple.strategy.slice_transfer import StepTransfers


class TrainCallbacks:
    """Enter the user's training_step on the first and last stages (module_adapter), with
    the fields of each slice that the step reads on the device (slice_transfer)."""

    def __init__(
        self,
        module: LightningModule,
        batch_idx: int,
        recorder: LogRecorder,
        transfers: StepTransfers,
        batch_rows: int,
        context: Callable[[], ContextManager] = nullcontext,
        scale_backward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        loss_watch: LossWatch | None = None,
        traced_inputs: tuple[str, ...] | None = None,
    ) -> None:
        self.module = module
        self.traced_inputs = traced_inputs
        self.loss_watch = loss_watch  # the first step: is the loss a mean over samples (loss_check.py)
        self.batch_idx = batch_idx
        self.recorder = recorder
        self.transfers = transfers
        self.step = module.training_step
        self.batch_rows = batch_rows
        self.context = context  # autocast under mixed precision: the user's step runs inside it, as in Lightning
        self.scale_backward = scale_backward  # fp16: the loss scale, applied where the backward starts

    def make_input(self, batch: Any) -> Any:
        return self.transfers.first.run(batch, self._make_input)

    def _make_input(self, batch: Any) -> Any:
        with self.recorder.recording(self.module, 0.0), self.context():
            return capture_input(self.module, lambda: self.step(batch, self.batch_idx), self.traced_inputs)

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        weight = batch_size_of(batch) / self.batch_rows
        return self.transfers.last.run(batch, lambda on_device: self._compute_loss(on_device, forward, weight))

    def _compute_loss(self, batch: Any, forward: Callable[..., Any], weight: float) -> torch.Tensor:
        watch = self.loss_watch.watching(batch_size_of(batch), batch) if self.loss_watch is not None else nullcontext()
        if self.loss_watch is not None:
            forward = self.loss_watch.marking(forward)
        with forward_replaced(self.module, forward, self.traced_inputs), self.recorder.recording(self.module, weight), self.context(), watch:
            loss = loss_of(self.step(batch, self.batch_idx))
        if self.loss_watch is not None:
            self.loss_watch.check(loss)
        return self.scale_backward(loss) if self.scale_backward is not None else loss


class EvalCallbacks:
    def __init__(
        self, module: LightningModule, step_name: str, args: tuple, recorder: LogRecorder, transfers: StepTransfers, traced_inputs: tuple[str, ...] | None = None
    ) -> None:
        self.module = module
        self.step_name = step_name
        self.traced_inputs = traced_inputs
        self.step = getattr(module, step_name)
        self.args = args
        self.recorder = recorder
        self.transfers = transfers
        self.keep_output = step_name == "predict_step"

    def make_input(self, batch: Any) -> Any:
        return self.transfers.first.run(batch, self._make_input)

    def _make_input(self, batch: Any) -> Any:
        with self.recorder.recording(self.module, 0.0):
            return capture_input(self.module, lambda: self.step(batch, *self.args), self.traced_inputs, self.step_name)

    def compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        return self.transfers.last.run(batch, lambda on_device: self._compute_output(on_device, forward, weight))

    def _compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        with forward_replaced(self.module, forward, self.traced_inputs, self.step_name), self.recorder.recording(self.module, weight):
            output = self.step(batch, *self.args)
        if not self.keep_output:
            return None
        return _to_cpu(output)


def _to_cpu(value: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def combine_outputs(parts: list[Any]) -> Any:
    if parts and all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts):
        return torch.cat(parts)
    if parts and all(isinstance(p, dict) for p in parts):
        return {key: combine_outputs([p[key] for p in parts]) for key in parts[0]}
    if parts and all(isinstance(p, (tuple, list)) for p in parts):
        return type(parts[0])(combine_outputs(list(items)) for items in zip(*parts))
    return parts


def current_step_name(trainer: Trainer) -> str:
    """The step function the Trainer runs now (it calls ``self(...)``); a Trainer not
    running yet is taken to fit."""
    return {
        TrainerFn.VALIDATING: "validation_step",
        TrainerFn.TESTING: "test_step",
        TrainerFn.PREDICTING: "predict_step",
    }.get(trainer.state.fn, "training_step")


def forward_args(module: LightningModule, batch: Any, step_name: str) -> tuple:
    """The positional arguments the step passes to ``self(...)`` for ``batch``."""
    with LogRecorder().recording(module, 0.0):
        return capture_call(module, lambda: getattr(module, step_name)(batch, 0))


def merge_logs(per_replica: list[Logs | None]) -> Logs:
    merged: Logs = {}
    for logs in per_replica:
        for name, (total, weight, kwargs) in (logs or {}).items():
            if name in merged:
                merged[name] = (*combine_logged(merged[name][:2], (total, weight), kwargs), kwargs)
            else:
                merged[name] = (total, weight, kwargs)
    return merged


def grads_zeroed_after_step(trainer: Trainer, batch_idx: int, params: Sequence[torch.Tensor], stepped: set[int]) -> bool:
    """Whether Lightning's automatic optimization sets every one of ``params``' gradients to
    None right after this training step, before anything can read them: the first batch of
    an accumulation window, the default ``optimizer_zero_grad``, no ``on_before_zero_grad``
    hook (which would read the previous step's gradients), every parameter in an optimizer."""
    module = trainer.lightning_module
    if batch_idx % trainer.accumulate_grad_batches or is_overridden("optimizer_zero_grad", module):
        return False
    if is_overridden("on_before_zero_grad", module) or any(
        is_overridden("on_before_zero_grad", callback, parent=Callback) for callback in trainer.callbacks
    ):
        return False
    return all(id(p) in stepped for p in params)


def check_rates_kept(optimizers: Sequence[Any], before: list[Any]) -> None:
    """The step left every learning rate as it found it (``learning_rates`` before it)."""
    require(
        learning_rates(optimizers) == before,
        "training_step",
        "changes a learning rate (a scheduler's step(), or param_groups[...]['lr'] set in the step), but the step runs "
        "once per micro-batch, and past self(...) only on the last stage's ranks: the stages would train at other rates",
        "step the scheduler from configure_optimizers (interval='step'), or in on_train_batch_start / on_train_batch_end, "
        "which run once per batch on every rank",
    )


def learning_rates(optimizers: Sequence[Any]) -> list[Any]:
    """Every group's learning rate; a tensor one by its in-place version (no device read)."""
    return [
        (id(lr), lr._version) if isinstance(lr, torch.Tensor) else lr
        for optimizer in optimizers
        for lr in (group.get("lr") for group in optimizer.param_groups)
    ]


def value_dtype(module: LightningModule) -> torch.dtype:
    """The dtype the step's loss and logged values reach Lightning in: the module's
    parameters' (frozen ones count: a stage may train none), as one device's would be."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), module.dtype)
