"""Mixed precision (``bf16-mixed``, ``16-mixed``) for pipelined training.

Lightning's ``MixedPrecision`` plugin does the work of one device: autocast around the
forward, fp32 master weights, and for fp16 a ``GradScaler`` that multiplies the loss
before the backward, divides the gradients after it and skips the optimizer step when a
gradient is inf/nan. In a pipeline the backward is the executor's (the stages' backward
runs inside ``training_step``, DAPPLE 5.2), and every rank holds a different part of the
parameters, so two things change:

* autocast must surround every stage forward and every recomputation (GPipe 2.3
  re-materialisation replays the forward, which must be bit-identical in dtype), not the
  whole step: the executor enters ``forward_context`` around exactly those;
* the inf/nan check must be agreed. Rank A finding an inf in its stage's gradients and
  skipping its step while rank B steps would leave the model half-updated, and the
  scales would drift apart. ``DappleMixedPrecision`` all-reduces ``found_inf`` (max) over
  every rank of the plan after unscaling and before the step, so all ranks skip or step
  together and update the scale identically.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.execute.groups import collective_device

__all__ = ["DappleMixedPrecision", "agree_found_inf", "as_dapple_precision"]


def agree_found_inf(scaler: "torch.amp.GradScaler", optimizer: Any, group: Any = None, wait: Callable[[Any, str], None] | None = None) -> bool:
    """Make the scaler's inf/nan record for ``optimizer`` the maximum over ``group``.

    Call after ``scaler.unscale_(optimizer)`` and before ``scaler.step``; afterwards every
    rank's ``step`` skips or steps alike and ``update`` changes the scale alike. ``wait``
    bounds the collective (the failure channel's wait). Returns whether a rank found one.
    """
    state = scaler._per_optimizer_states[id(optimizer)]
    found = state.get("found_inf_per_device") or {}
    device = next(iter(found)) if found else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float32)
    for value in found.values():
        local += value.detach().to("cpu", torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        carrier = local.to(collective_device(group, device))
        work = dist.all_reduce(carrier, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if wait is not None:
            wait(work, "the mixed-precision inf/nan check")
        else:
            work.wait()
        local = carrier.cpu()
    agreed = (local > 0).to(torch.float32)
    state["found_inf_per_device"] = {device: agreed.to(device)}
    return bool(agreed.item())


class DappleMixedPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` whose fp16 step is agreed over the pipeline.

    ``agree`` is set by the strategy once its groups exist: it receives the scaler and the
    optimizer after unscaling (``agree_found_inf`` with the plan's group). Without it (no
    pipeline yet) the plugin behaves as Lightning's.
    """

    def __init__(self, precision: Any, device: str, scaler: Any = None) -> None:
        super().__init__(precision, device, scaler)
        self.agree: Callable[[Any, Any], bool] | None = None
        self.skipped_steps = 0

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)
            return closure_result
        self.scaler.unscale_(optimizer)
        if self.agree is not None and self.agree(self.scaler, optimizer):
            self.skipped_steps += 1
        self._after_closure(model, optimizer)
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def check_optimizers(self, optimizers: list[Any]) -> None:
        """fp16: an optimizer that unscales inside its own step (a fused one) would decide
        alone whether to skip, so the pipeline could not agree; refused before training."""
        if self.scaler is None:
            return
        for optimizer in optimizers:
            require(
                not _optimizer_handles_unscaling(optimizer),
                "Trainer(precision='16-mixed')",
                f"{type(optimizer).__name__} unscales inside its own step (a fused optimizer), so the pipeline stages "
                "cannot agree on skipping an overflowing step",
                "use a non-fused optimizer (e.g. fused=False), or precision='bf16-mixed'",
            )

    def loss_scale(self) -> float:
        """The factor the executor's backward multiplies the loss by (1.0 without a scaler)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0


def as_dapple_precision(plugin: Any) -> Any:
    """``plugin`` unchanged, or a ``MixedPrecision`` turned into ``DappleMixedPrecision``
    (same precision, device and scaler object, so a checkpointed scale still loads)."""
    if isinstance(plugin, MixedPrecision) and not isinstance(plugin, DappleMixedPrecision):
        return DappleMixedPrecision(plugin.precision, plugin.device, plugin.scaler)
    return plugin
