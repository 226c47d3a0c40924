"""One optimizer step per layer, measured beside the layer times: ``LayerProfile.optimizer_ms``.

DAPPLE's latency model (sec. 4.1) ends a step with the AllReduce of every replicated stage;
a real step then runs the optimizer over each stage's parameters, on every replica. That
time depends on the parameters and the optimizer, not on the micro-batch, and a plan moves
it: a straight pipeline splits the model's optimizer step across its stages, data
parallelism repeats the whole of it on every device. On small models it is a large share of
a step: in a quick-start profile on CPU, AdamW over one BERT block took 1.9 ms against 2.5 ms
for the block's forward and backward on 8 rows.

``measure_optimizer_ms`` times the run's own optimizer (``make_optimizer``: a fresh instance
of the class and settings the module's ``configure_optimizers`` returns) over each layer's
parameters in turn: gradients of zeros, ``warmup`` untimed steps (which create the state),
the median of ``repeats`` timed steps. Every parameter's values and gradient are put back
afterwards, so the model leaves the probe as it came. A tied parameter counts in its first
layer only, as ``param_bytes`` counts it; parameter groups' own settings are not copied
(every layer gets the optimizer's defaults), which changes what is computed, not how much.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import nn

from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.profiler import timed_ms

__all__ = ["OptimizerFactory", "measure_optimizer_ms", "with_optimizer_ms"]

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _layer_params(layer: nn.Module, seen: set[int]) -> list[nn.Parameter]:
    """The layer's trainable parameters not counted in an earlier layer (``seen``)."""
    out = []
    for param in layer.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def _time_steps(params: list[nn.Parameter], make_optimizer: OptimizerFactory, device: torch.device, repeats: int, warmup: int) -> float:
    """Median ms of one step of a fresh optimizer over ``params``; values and gradients restored."""
    saved = [param.detach().clone() for param in params]
    grads = [param.grad for param in params]
    try:
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer = make_optimizer(params)
        times = []
        for index in range(warmup + repeats):
            elapsed, _ = timed_ms(device, optimizer.step)
            if index >= warmup:
                times.append(elapsed)
        del optimizer
        return statistics.median(times)
    finally:
        with torch.no_grad():
            for param, value, grad in zip(params, saved, grads):
                param.copy_(value)
                param.grad = grad


def measure_optimizer_ms(
    layers: Sequence[nn.Module],
    make_optimizer: OptimizerFactory,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
) -> list[float]:
    """Milliseconds of one ``make_optimizer`` step over each layer's parameters on ``device``
    (module docstring); 0 for a layer with none. Each layer is moved to ``device`` for its
    measurement and back, as ``profile_layers`` moves it."""
    dev = torch.device(device)
    seen: set[int] = set()
    out = []
    for layer in layers:
        params = _layer_params(layer, seen)
        if not params:
            out.append(0.0)
            continue
        home = params[0].device
        layer.to(dev)
        try:
            out.append(_time_steps(params, make_optimizer, dev, repeats, warmup))
        finally:
            layer.to(home)
    return out


def with_optimizer_ms(profile: ModelProfile, optimizer_ms: Sequence[float]) -> ModelProfile:
    """``profile`` with each layer's ``optimizer_ms`` set (one value per layer)."""
    if len(optimizer_ms) != len(profile.layers):
        raise ValueError(f"{len(optimizer_ms)} optimizer times for {len(profile.layers)} layers")
    layers = tuple(replace(layer, optimizer_ms=float(ms)) for layer, ms in zip(profile.layers, optimizer_ms))
    return replace(profile, layers=layers)
