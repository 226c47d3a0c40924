"""Lightning's precision plugins as the pipeline needs them (``32-true``, ``64-true``,
``bf16-true``, ``16-true``, ``bf16-mixed``, ``16-mixed``).

Each plugin is Lightning's own, subclassed the way Lightning's strategies customise theirs
(FSDP's and DeepSpeed's precision plugins): the strategy turns the plugin the Trainer
made into its dapple form (``as_dapple_precision``), which changes what a pipeline changes
and nothing else.

* Gradient clipping by norm (every plugin): a rank holds only its stage's parameters, so
  the norm is the global one over all stages (``execute/clipping.py``), handed in by the
  strategy as ``clip_norm`` once its process groups exist.

Mixed precision: Lightning's ``MixedPrecision`` does the work of one device: autocast
around the forward, fp32 master weights, and for fp16 a ``GradScaler`` that multiplies the
loss before the backward, divides the gradients after it and skips the optimizer step
when a gradient is inf/nan. In a pipeline the backward is the executor's (the stages'
backward runs inside ``training_step``, DAPPLE 5.2), and every rank holds a different part
of the parameters, so three things change:

* autocast must surround every stage forward and every recomputation (GPipe 2.3
  re-materialisation replays the forward, which must be bit-identical in dtype), not the
  whole step: the executor enters ``forward_context`` around exactly those;
* the loss scale multiplies the gradient where the pipeline's backward starts
  (``scale_backward``): the scale is a tensor on the device and is never read on the host,
  and the loss's forward value (what is reported) is the loss itself;
* the inf/nan check must be agreed. Rank A finding an inf in its stage's gradients and
  skipping its step while rank B steps would leave the model half-updated, and the
  scales would drift apart. ``DappleMixedPrecision`` all-reduces ``found_inf`` (max) over
  every rank of the plan after unscaling and before the step, so all ranks skip or step
  together and update the scale identically. The flag stays on the rank's device (also
  on a rank whose parameters got no gradient); only gloo takes it through the host.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.plugins.precision.half import HalfPrecision
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.execute.groups import collective_device

__all__ = [
    "DappleDoublePrecision",
    "DappleHalfPrecision",
    "DappleMixedPrecision",
    "DapplePrecision",
    "GlobalNormClipping",
    "agree_found_inf",
    "as_dapple_precision",
]


def agree_found_inf(
    scaler: "torch.amp.GradScaler",
    optimizer: Any,
    device: torch.device,
    group: Any = None,
    wait: Callable[[Any, str], None] | None = None,
) -> torch.Tensor:
    """Make the scaler's inf/nan record for ``optimizer`` the maximum over ``group``.

    Call after ``scaler.unscale_(optimizer)`` and before ``scaler.step``; afterwards every
    rank's ``step`` skips or steps alike and ``update`` changes the scale alike. The flag
    is built on ``device`` (the rank's device, also when none of its parameters has a
    gradient and the scaler recorded nothing), so NCCL can reduce it and nothing is read
    on the host. ``wait`` bounds the collective (the failure channel's wait). Returns the
    agreed flag (1.0: a rank found one), on ``device``.
    """
    state = scaler._per_optimizer_states[id(optimizer)]
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for found in (state.get("found_inf_per_device") or {}).values():
        flag += found.to(device, torch.float32, non_blocking=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        carrier = flag.to(collective_device(group, device))  # gloo reduces host tensors
        work = dist.all_reduce(carrier, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if wait is not None:
            wait(work, "the mixed-precision inf/nan check")
        else:
            work.wait()
        flag = carrier.to(device, non_blocking=True)
    agreed = (flag > 0).to(torch.float32)
    state["found_inf_per_device"] = {device: agreed}
    return agreed


class GlobalNormClipping:
    """Clipping by norm with the norm over all stages (``clip_norm``, set by the strategy:
    it receives the optimizer's parameters and the maximum norm). Without it (no pipeline
    yet) the plugin clips as Lightning's does."""

    clip_norm: Callable[[list[torch.Tensor], float], Any] | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self.clip_norm is None:
            super().clip_grad_by_norm(optimizer, clip_val)  # type: ignore[misc]
            return
        self.clip_norm([p for group in optimizer.param_groups for p in group["params"]], float(clip_val))


class DapplePrecision(GlobalNormClipping, Precision):
    """``32-true`` in a pipeline."""


class DappleDoublePrecision(GlobalNormClipping, DoublePrecision):
    """``64-true`` in a pipeline."""


class DappleHalfPrecision(GlobalNormClipping, HalfPrecision):
    """``bf16-true`` and ``16-true`` in a pipeline."""


class DappleMixedPrecision(GlobalNormClipping, MixedPrecision):
    """Lightning's ``MixedPrecision`` whose fp16 step is agreed over the pipeline.

    ``agree`` is set by the strategy once its groups exist: it receives the scaler and the
    optimizer after unscaling (``agree_found_inf`` with the plan's group and the rank's
    device). Without it (no pipeline yet) the plugin behaves as Lightning's.
    """

    def __init__(self, precision: Any, device: str, scaler: Any = None) -> None:
        super().__init__(precision, device, scaler)
        self.agree: Callable[[Any, Any], Any] | None = None

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:  # type: ignore[override]
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            self._after_closure(model, optimizer)
            return closure_result
        self.scaler.unscale_(optimizer)
        if self.agree is not None:
            self.agree(self.scaler, optimizer)
        self._after_closure(model, optimizer)
        step_output = self.scaler.step(optimizer, **kwargs)  # GradScaler reads the agreed flag here (its one host read)
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

    def scale_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` whose gradient is multiplied by the GradScaler's scale (fp16), ``loss``
        itself without a scaler: the backward then starts from loss x scale, as Lightning's
        ``scaler.scale(loss).backward()``, with the scale kept on the device."""
        if self.scaler is None:
            return loss
        return _ScaledGradient.apply(loss, self.scaler)


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by the scaler's scale
    (``GradScaler.scale``, a device multiply: the scale is never read on the host). The
    scale is a power of two, so the product equals scaling the loss itself."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scaler: Any) -> torch.Tensor:
        ctx.scaler = scaler
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.scaler.scale(grad), None


# Lightning's plugins and their pipeline forms (exact types: a subclass of one of these
# carries its own behaviour, which the pipeline form would silently drop)
_DAPPLE_FORMS: dict[type, Callable[[Any], Precision]] = {
    Precision: lambda plugin: DapplePrecision(),
    DoublePrecision: lambda plugin: DappleDoublePrecision(),
    HalfPrecision: lambda plugin: DappleHalfPrecision(plugin.precision),
    MixedPrecision: lambda plugin: DappleMixedPrecision(plugin.precision, plugin.device, plugin.scaler),
}


def as_dapple_precision(plugin: Any) -> Any:
    """The pipeline form of one of Lightning's precision plugins (same precision, device
    and scaler object, so a checkpointed scale still loads); anything else unchanged (the
    strategy's setup refuses what it does not support)."""
    convert = _DAPPLE_FORMS.get(type(plugin))
    return convert(plugin) if convert is not None else plugin
