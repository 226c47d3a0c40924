"""The Lightning step hooks of ``DappleStrategy``: ``training_step`` runs the whole schedule for the
global batch, ``backward`` restores its gradients, the evaluation steps run the forward
schedule, and the optimizer step, clipping and mixed precision see the stage's parameters.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.slicing import batch_size_of
from lightning_dapple.strategy.batch_guard import (
    check_training_batch,
    check_training_loss,
)
from lightning_dapple.strategy.loss_check import LossWatch
from lightning_dapple.strategy.module_adapter import (
    LogRecorder,
    Logs,
    combination_notice,
    replay_logs,
)
from lightning_dapple.strategy.precision import (
    DappleMixedPrecision,
    agree_found_inf,
)
from lightning_dapple.strategy.slice_transfer import StepTransfers
from lightning_dapple.strategy.step_callbacks import (
    check_rates_kept,
    combine_outputs,
    EvalCallbacks,
    grads_zeroed_after_step,
    learning_rates,
    merge_logs,
    TrainCallbacks,
    value_dtype,
)


class PipelineSteps:
    """Part of :class:`~lightning_dapple.strategy.dapple_strategy.DappleStrategy` (module docstring);
    its methods read the strategy's state, set up in ``DappleStrategy.__init__``."""

    def _stepped_parameters(self) -> set[int]:
        """The parameters the optimizers step (by id), ZeRO-1's other shares included: the
        gradients Lightning's ``zero_grad`` (or the share exchange) clears after a step."""
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
        return {id(p) for p in (self._zero.complete(params) if self._zero is not None else params)}

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; under ZeRO-1 the replicas then exchange what each stepped."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._zero is not None:
            self._zero.share(optimizer)
        return output

    def _mixed(self) -> DappleMixedPrecision | None:
        plugin = self.precision_plugin
        return plugin if isinstance(plugin, DappleMixedPrecision) else None

    def _forward_context(self) -> Callable[[], ContextManager] | None:
        """What the executor enters around every stage forward and recomputation: autocast
        under mixed precision (the same dtype in the replayed forward as in the first)."""
        mixed = self._mixed()
        return mixed.forward_context if mixed is not None else None

    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in under mixed precision (None otherwise)."""
        mixed = self._mixed()
        if mixed is None:
            return None
        return torch.bfloat16 if mixed.precision == "bf16-mixed" else torch.float16

    def _clip_by_global_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        assert self.plan is not None
        if self._zero is not None:  # the norm is over the stage's gradients, not this replica's share
            params = self._zero.complete(params)
        replicas = self.plan.stages[self.stages[0]].replicas  # the rank's chunks share their devices
        group = self.groups.plan if self.groups else None
        tied = self.runner.tied if self.runner is not None else None  # tied copies count once
        copies = tied.copies if tied is not None else None
        shares = self._zero.shares if self._zero is not None else None  # each owner counts its share
        clip_grad_norm_global(params, max_norm, replicas, self.failure, group=group, device=self.root_device, copies=copies, shares=shares)

    def _agree_found_inf(self, scaler: Any, optimizer: Any) -> torch.Tensor:
        """fp16: every rank of the plan skips or takes the step together (precision.py)."""
        assert self.failure is not None
        group = self.groups.plan if self.groups else None
        return agree_found_inf(scaler, optimizer, self.root_device, group=group, wait=self.failure.wait)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The loops' batch stays where the DataLoader put it: each stage moves only the
        rows and fields it reads, per slice (``slice_transfer.py``; a middle stage moves
        nothing). A module with its own transfer hooks, and a call naming a device, get
        Lightning's whole-batch transfer."""
        if device is None and self.runner is not None and self._stages_move_slices:
            return batch
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    def _transfers_for(self, step_name: str) -> StepTransfers:
        """What the slices of ``step_name`` move to this rank's device (learned per step function)."""
        transfers = self._transfers.get(step_name)
        if transfers is None:
            transfers = self._transfers[step_name] = StepTransfers(self.root_device)
        return transfers

    @property
    def _logs_travel(self) -> bool:
        """Whether the last stage's logged values go to other ranks (through the host)."""
        return self.plan is not None and self.plan.world_size > 1

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.runner is not None and self.plan is not None
        module = self.lightning_module
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        recorder = LogRecorder()
        mixed = self._mixed()
        # Mixed precision: autocast around the forwards only (the executor's
        # forward_context and the user's step), never around the backward.
        context = mixed.forward_context if mixed is not None else nullcontext
        transfers = self._transfers_for("training_step")
        scale_backward = mixed.scale_backward if mixed is not None else None
        sliced = self.plan.micro_batches * self.plan.stages[-1].replicas > 1  # else each loss is the whole batch's
        watch = LossWatch() if self.loss_reduction == "mean" and sliced and not self._loss_checked else None
        self._loss_checked = True
        callbacks = TrainCallbacks(module, batch_idx, recorder, transfers, batch_size_of(batch), context, scale_backward, watch, self._traced_inputs)
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        self.runner.refresh_trainable()  # a callback may have frozen or unfrozen layers since the last step
        if self._zero is not None:  # ZeRO-2: the (rebuilt) buckets reduce to the owners
            self._zero.route_gradients(self.runner)
        params = self.runner.parameters
        # Under Trainer(accumulate_grad_batches) the gradients of earlier batches are still
        # in .grad; the runner starts from none, so they are put back after the step. Where
        # Lightning zeroes them right after this step anyway, they go now: the stage would
        # otherwise hold two sets of gradients while the step runs.
        if grads_zeroed_after_step(self.lightning_module.trainer, batch_idx, params, self._stepped_parameters()):
            for param in params:
                param.grad = None
        previous = [p.grad for p in params]
        rates = learning_rates(self.optimizers)
        try:
            check_training_batch(self, batch, batch_idx)  # a bad batch is named before any rank runs it
            with nullcontext() if mixed is not None else self.precision_plugin.train_step_context():
                loss, logs = self.runner.train_step(batch, callbacks, extras=lambda: recorder.summary(on_host=self._logs_travel))
            check_training_loss(self, loss, batch_idx)  # before the optimizer takes it in
            check_rates_kept(self.optimizers, rates)
        except BaseException as exc:
            self.failure.report(exc)
            raise
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self._saved_grads = [p.grad for p in params]
        for p, grad in zip(params, previous):
            p.grad = grad
        dtype = value_dtype(module)
        replay_logs(module, self._noticed(merge_logs(logs)), callbacks.batch_rows, dtype)
        # on the device, as Lightning's loops expect (fp16: its loss scaling stays there too)
        return {"loss": loss.to(device=self.root_device, dtype=dtype, non_blocking=True)}

    def _noticed(self, logs: Logs) -> Logs:
        """``logs``, after warning once per name (rank 0, which replays them too) about a value
        logged with reduce_fx max, min or sum on a plan that cuts the batch
        (``module_adapter.combination_notice``)."""
        assert self.plan is not None
        for name, (_, _, kwargs) in logs.items():
            if name in self._noticed_logs:
                continue
            self._noticed_logs.add(name)
            notice = combination_notice(name, kwargs, self.plan.micro_batches, self.plan.stages[-1].replicas)
            if notice is not None:
                rank_zero_warn(notice)
        return logs

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The pipeline already ran every backward; restore its gradients, run the hooks."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._saved_grads is not None and self.runner is not None:
            for param, grad in zip(self.runner.parameters, self._saved_grads):
                if grad is None:
                    continue
                param.grad = grad if param.grad is None else param.grad + grad
            self._saved_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    def _eval(self, step_name: str, args: tuple) -> Any:
        assert self.runner is not None
        module = self.lightning_module
        batch = args[0]
        recorder = LogRecorder()
        callbacks = EvalCallbacks(module, step_name, tuple(args[1:]), recorder, self._transfers_for(step_name), self._traced_inputs)
        try:
            with torch.no_grad():
                outputs = self.runner.forward_step(batch, callbacks)
                logs = self.runner.share_extras(recorder.summary(on_host=self._logs_travel) if self.runner.is_last else None)
        except BaseException as exc:
            self.failure.report(exc)
            raise
        dtype = value_dtype(module)
        replay_logs(module, self._noticed(merge_logs(logs)), batch_size_of(batch), dtype)
        return combine_outputs(outputs) if step_name == "predict_step" else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval("validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval("test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval("predict_step", args)
