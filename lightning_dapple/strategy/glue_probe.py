"""Measure the user's step around the layers at set-up (``StepGlue``, ``profile/step_glue.py``).

The executor runs the user's ``training_step`` on the first stage up to ``self(...)``, to
make the input (``step_callbacks.TrainCallbacks.make_input``), and on the last stage whole,
with ``self(...)`` answered by the pipeline's output (``compute_loss``); the loss's
backward then runs into the last stage's layers. The layer profile (PipeDream 3.2) times
none of that. This probe runs the same calls on the planning slice, with the model's
output computed once beforehand (``profiler.run_layers_once``) and handed back by
``self(...)`` at once, so what it times is the step's own code:

* ``input``: ``capture_input``, the step until its ``self(...)`` call;
* ``loss_forward``: the whole step with ``self(...)`` answered (``forward_replaced``), its
  ``self.log`` calls recorded as the run records them (``LogRecorder``);
* ``loss_backward``: the gradient of the loss with respect to the model output
  (``torch.autograd.grad``, so no parameter's ``.grad`` is touched), timed alone after an
  untimed forward.

Each is the median of ``repeats`` calls after ``warmup``. The torchmetrics states the step
updates are put back afterwards (``metric_state.MetricStates``) and the RNG is forked, so
the run's metrics and random stream are those of a run without the probe. What the step
changes besides metrics and ``self.log`` (a list of outputs it appends to, a logger it
writes to directly) sees the probe's calls, as it would see tuning trials. A step the probe
cannot run this way (it fails on the planning slice outside a run, for example; a warning
says so), or a module that waits on the host while the run trains on a GPU, is not priced:
the profile records why in ``meta["step_glue"]`` and charges no glue.
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.profiler import forked_rng, iter_tensors, map_tensors, run_layers_once
from lightning_dapple.profile.step_glue import StepGlue
from lightning_dapple.profile.timing import median_ms, timed_ms
from lightning_dapple.strategy.metric_state import MetricStates
from lightning_dapple.strategy.module_adapter import LogRecorder, capture_input, forward_replaced, loss_of

__all__ = ["measure_step_glue", "with_step_glue"]


def measure_step_glue(
    module: LightningModule,
    layers: nn.Module,
    piece: Any,
    x: Any,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    repeats: int = 10,
    warmup: int = 2,
) -> StepGlue:
    """``StepGlue`` of ``module.training_step`` on the batch slice ``piece`` whose model input
    is ``x`` (module docstring). Raises what the step raises."""
    output = run_layers_once(layers, x, device, autocast_dtype)

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()

    def make_input() -> Any:
        with LogRecorder().recording(module, 0.0), autocast():
            return capture_input(module, lambda: module.training_step(piece, 0))

    leaves: list[torch.Tensor] = []

    def answer(*args: Any) -> Any:
        leaves.clear()

        def leaf(tensor: torch.Tensor) -> torch.Tensor:
            copy = tensor.detach().requires_grad_(tensor.is_floating_point())
            leaves.append(copy)
            return copy

        return map_tensors(output, leaf)

    def compute_loss() -> torch.Tensor:
        with forward_replaced(module, answer), LogRecorder().recording(module, 1.0), autocast():
            return loss_of(module.training_step(piece, 0))

    def loss_backward_ms() -> float:
        """One loss's backward down to the output copies, timed alone (its forward is not)."""
        loss = compute_loss()
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        if not (loss.requires_grad and wanted):
            return 0.0
        return timed_ms(device, lambda: torch.autograd.grad(loss, wanted, allow_unused=True))[0]

    metrics = MetricStates(module)
    try:
        with forked_rng(device):
            input_ms = median_ms(device, make_input, repeats, warmup)
            forward_ms = median_ms(device, compute_loss, repeats, warmup)
            for _ in range(warmup):
                loss_backward_ms()
            backward_ms = statistics.median(loss_backward_ms() for _ in range(repeats))
    finally:
        metrics.restore()
    return StepGlue(input=input_ms, loss_forward=forward_ms, loss_backward=backward_ms)


def with_step_glue(
    profile: ModelProfile, module: LightningModule, layers: nn.Module, piece: Any, x: Any, device: torch.device, autocast_dtype: torch.dtype | None = None
) -> ModelProfile:
    """``profile`` with ``step_glue_ms`` measured on the run's step; where the step cannot be
    run that way, the profile without glue and the reason in ``meta["step_glue"]``."""
    def unmeasured(why: str) -> ModelProfile:
        return replace(profile, meta={**profile.meta, "step_glue": f"not measured: {why}"})

    if not any(True for _ in iter_tensors(x)):
        return unmeasured("the model input holds no tensor")
    where = next((tensor.device for tensor in iter_tensors(piece)), device)
    if where.type != device.type:  # the module waits on the host for its stages: its step would be timed on the wrong device
        return unmeasured(f"the planning batch is on {where.type} while the run trains on {device.type}")
    try:
        glue = measure_step_glue(module, layers, piece, x, where, autocast_dtype)
    except Exception as exc:  # pricing only: the run itself reports a step that fails
        rank_zero_warn(f"the training_step around the layers was not timed for the planner ({type(exc).__name__}: {exc}); its plan prices the layers alone")
        return unmeasured(f"{type(exc).__name__}: {exc}")
    return replace(profile, step_glue_ms=glue, meta={**profile.meta, "step_glue": "measured on the run's training_step"})
