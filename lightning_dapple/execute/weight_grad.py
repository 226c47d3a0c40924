"""The B/W split of out-of-order backprop without a second autograd pass.

ooo-backprop (sec. 3) splits a layer's backward into the output-gradient work (our B: the
gradient of the stage input, which the previous stage waits for) and the weight-gradient
work (our W, needed only by the optimizer). The GEMM-shaped operations carry almost all
of a layer's weight-gradient cost, and for them the split is exact and cheap: the weight
gradient of ``y = x W^T + b`` is ``dy^T x`` (and ``sum(dy)``), of a convolution it is the
convolution-backward with only the weight output asked for. So, during the forward of a
micro-batch whose backward is split, every ``nn.Linear`` and ``nn.Conv{1,2,3}d`` of the
stage runs through a small autograd function whose backward computes the input gradient
only and files ``(x, dy)`` under (micro-batch, layer) in a ``WeightGradStore``; W later
takes those pairs and computes the weight gradients. B is one ordinary
``torch.autograd.backward`` that frees the graph as it goes, exactly like an unsplit
backward; every other parameter (norms, embeddings, attention in-projections) gets its
gradient during B as usual. This is how Zero Bubble's weight-gradient store works; it
keeps nothing of the graph alive between B and W, only the pairs W needs.

Mixed precision: under autocast the function casts its inputs to the autocast dtype itself
(as autocast does for ``F.linear``), computes with autocast off, and returns weight
gradients in the parameter's dtype, which is what autograd gives through autocast's casts.
What a pending W keeps is (cast input, output gradient) and nothing of the weight: the
forward's cast copy of the weight is freed with the graph in B, for linear and
convolution layers alike.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.utils import parametrize

__all__ = ["WeightGradStore", "install_deferred_weights", "deferrable_modules"]

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class WeightGradStore:
    """Pending weight-gradient work of each micro-batch, per stage-local layer.

    ``recording`` is the micro-batch whose forward runs with deferral (``None``: modules run
    their ordinary forward, e.g. evaluation, a forward whose backward is not split, or the
    forward of a micro-batch that is recomputed later). ``splitting`` is the micro-batch
    whose B the executor is running: only that backward files weight work. Any other
    backward through a routed module (``torch.autograd.grad`` in the user's step: a
    gradient penalty, a physics-informed loss's du/dx with ``create_graph``) gets the
    module's whole backward, differentiable as ``nn.Linear``'s own.
    """

    def __init__(self) -> None:
        self.recording: int | None = None
        self.splitting: int | None = None
        # per micro-batch: (layer, its weight work, the tensors that work keeps alive)
        self._pending: dict[int, list[tuple[int, Callable[[], None], tuple[torch.Tensor, ...]]]] = {}

    def defer(self, microbatch: int, layer: int, work: Callable[[], None], kept: tuple[torch.Tensor, ...]) -> None:
        """File ``work`` for the W of ``microbatch``; ``kept``: what it holds until then (the
        module's input and its output gradient)."""
        self._pending.setdefault(microbatch, []).append((layer, work, kept))

    def held_bytes(self, microbatch: int) -> int:
        """Bytes the pending W work of ``microbatch`` keeps alive: each distinct tensor once
        (modules fed the same input share it), a view counting its own elements, as the
        stash rule counts (``profile/stash.py``). B freed the rest of the micro-batch's
        graph, so this is all it holds until its W (ooo-backprop sec. 3: "the weight
        gradient computation of a layer requires the layer's input and output gradient")."""
        seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
        total = 0
        for _, _, kept in self._pending.get(microbatch, ()):
            for tensor in kept:
                key = _view_key(tensor)
                if key not in seen:
                    seen.add(key)
                    total += tensor.numel() * tensor.element_size()
        return total

    def run(self, microbatch: int, layers: tuple[int, int] | None = None) -> None:
        """The weight gradients of ``microbatch``, last layer first; only those of
        ``layers`` (stage-local, half-open) when given."""
        pending = self._pending.get(microbatch)
        if not pending:
            return
        keep = []
        with torch.no_grad():  # the saved inputs require grad; the weight gradients must not
            for entry in reversed(pending):
                layer, work, _ = entry
                if layers is None or layers[0] <= layer < layers[1]:
                    work()
                else:
                    keep.append(entry)
        if keep:
            keep.reverse()
            self._pending[microbatch] = keep
        else:
            del self._pending[microbatch]

    def clear(self) -> None:
        self._pending.clear()
        self.recording = None


def _view_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """What makes two tensors the same memory for ``held_bytes``: storage, offset, shape, strides."""
    try:
        storage = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage: counted on its own
        return (id(tensor), 0, tuple(tensor.shape), ())
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as AccumulateGrad would."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad if grad.stride() == param.stride() else grad.contiguous()
    else:
        param.grad += grad


def _autocast_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The operands as autocast would give them to the GEMM (unchanged when it is off)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), (bias.to(dtype) if bias is not None else None)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: tuple) -> torch.Tensor:
        x, weight, bias = _autocast_operands(x, weight, bias)
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        store, microbatch, layer, module = ctx.slot
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if store.splitting != microbatch:  # not the executor's B: the whole backward, now
            flat_dy = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = flat_dy.t().mm(x.reshape(-1, x.shape[-1])).to(module.weight.dtype) if ctx.needs_input_grad[1] else None
            grad_b = flat_dy.sum(0).to(module.bias.dtype) if ctx.needs_input_grad[2] else None
            return grad_in, grad_w, grad_b, None

        def work() -> None:  # a weight frozen since set-up (a fine-tuning callback) gets nothing
            flat_dy = grad_out.reshape(-1, grad_out.shape[-1])
            if module.weight.requires_grad:
                _accumulate(module.weight, flat_dy.t().mm(x.reshape(-1, x.shape[-1])))
            if module.bias is not None and module.bias.requires_grad:
                _accumulate(module.bias, flat_dy.sum(0))

        store.defer(microbatch, layer, work, (x, grad_out))
        return grad_in, None, None, None


class _DeferredConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: tuple) -> torch.Tensor:
        x, weight, bias = _autocast_operands(x, weight, bias)
        module = slot[3]
        with torch.autocast(x.device.type, enabled=False):
            out = module._conv_forward(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.slot = slot
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        store, microbatch, layer, module = ctx.slot
        args = (module.stride, _padding(module), module.dilation, False, [0] * len(module.stride), module.groups)
        bias_sizes = [weight.shape[0]] if ctx.has_bias else None
        if store.splitting != microbatch:  # not the executor's B: the whole backward, now (as _DeferredLinear)
            wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
            grad_in, grad_w, grad_b = torch.ops.aten.convolution_backward(grad_out, x, weight, bias_sizes, *args, wanted)
            return grad_in, (grad_w.to(module.weight.dtype) if wanted[1] else None), (grad_b.to(module.bias.dtype) if wanted[2] else None), None
        grad_in = None
        if ctx.needs_input_grad[0]:
            grad_in = torch.ops.aten.convolution_backward(grad_out, x, weight, bias_sizes, *args, [True, False, False])[0]
        work = partial(_conv_weight_work, module, grad_out, x, weight.shape, bias_sizes, args)
        store.defer(microbatch, layer, work, (x, grad_out))
        return grad_in, None, None, None


def _conv_weight_work(
    module: nn.Module, grad_out: torch.Tensor, x: torch.Tensor, weight_shape: torch.Size, bias_sizes: list[int] | None, args: tuple
) -> None:
    """The W of one convolution: its weight (and bias) gradient from (x, dy).

    The weight's values do not enter its own gradient, only its shape and dtype, so W keeps
    neither the weight nor, under autocast, the cast copy of it that the forward made
    (weight bytes per pending micro-batch): a one-element stand-in expanded to the weight's
    shape takes its place, as ``torch.nn.grad.conv2d_weight`` does.
    """
    stand_in = grad_out.new_empty(1).expand(weight_shape)
    weight = module.weight.requires_grad  # a weight frozen since set-up gets nothing
    bias = bias_sizes is not None and module.bias.requires_grad
    if not (weight or bias):
        return
    _, grad_w, grad_b = torch.ops.aten.convolution_backward(grad_out, x, stand_in, bias_sizes, *args, [False, weight, bias])
    if weight:
        _accumulate(module.weight, grad_w)
    if bias:
        _accumulate(module.bias, grad_b)


def _padding(module: nn.Module) -> Any:
    padding = module.padding
    if isinstance(padding, str):  # 'same' / 'valid': the module pads explicitly below
        raise ValueError("string padding is not deferrable")
    return padding


def deferrable_modules(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` whose weight gradient W can compute alone: plain
    ``nn.Linear`` and zero-padded ``nn.Conv*d`` (not subclasses with their own forward)
    with a trainable weight that is the parameter itself. A parametrized one (weight
    normalisation, spectral norm) computes ``weight`` from other parameters in the forward:
    its gradient must flow back through that computation, so its backward stays whole. So
    does a ``torch.compile``d block's: its modules run inside one compiled program, whose
    backward runs once per forward (the profiler times it whole as B)."""
    compiled = {id(inner) for block in layer.modules() if isinstance(block, OptimizedModule) for inner in block.modules()}
    found = []
    for module in layer.modules():
        if id(module) in compiled or parametrize.is_parametrized(module) or not isinstance(getattr(module, "weight", None), nn.Parameter):
            continue
        kind = type(module)
        plain_linear = isinstance(module, nn.Linear) and kind.forward is nn.Linear.forward
        plain_conv = (
            isinstance(module, _CONV)
            and kind.forward in (c.forward for c in _CONV)
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        )
        if (plain_linear or plain_conv) and module.weight.requires_grad:
            found.append(module)
    return found


def _deferred_forward(module: nn.Module, store: WeightGradStore, layer: int, original: Callable[..., Any], x: torch.Tensor) -> Any:
    microbatch = store.recording
    if microbatch is None or not torch.is_grad_enabled():
        return original(x)
    function = _DeferredLinear if isinstance(module, nn.Linear) else _DeferredConv
    return function.apply(x, module.weight, module.bias, (store, microbatch, layer, module))


def install_deferred_weights(layers: Sequence[nn.Module], store: WeightGradStore) -> int:
    """Route the deferrable modules of ``layers`` through ``store`` while it records;
    returns how many were routed. Installed once per ``Stage`` (set-up, not per step)."""
    count = 0
    for index, layer in enumerate(layers):
        for module in deferrable_modules(layer):
            original = type(module).forward.__get__(module)
            module.forward = partial(_deferred_forward, module, store, index, original)
            count += 1
    return count
