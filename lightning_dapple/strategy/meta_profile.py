"""``plan="auto"`` for a model built on the meta device: one layer real at a time.

The planner needs each layer's measured times and sizes (DAPPLE 4.1), which a layer on the
meta device cannot give, and no rank may make the whole model (that is why it was built on
the meta device). So rank 0 makes one layer real (``MetaBuild.materialized``: replayed
from the build's record, or read from a pretrained directory), profiles it on the previous
layer's output as ``profile_layers`` would (PipeDream 3.2's profiler, one layer on the
device at a time), times the run's optimizer step over it, computes its output for the
next layer, and frees it to the meta device again before the next one is made. Its peak
is one layer (with its optimizer state while that step is timed) and the activations of one
micro-batch.

Each layer's values are those of the whole model built on the CPU: every tensor is
replayed from the generator state its own recorded operation started from, so making
layer 3 before layer 2, or alone, draws the same numbers (``meta_build.py``). The stage
each rank then makes is made the same way, so the profiled layer and the trained one are
the same tensors' values.

The profile is assembled from the per-layer ones as ``profile_layers`` assembles its own:
a tied parameter's bytes count in the first layer that uses it, and the profile's ``tied``
says which layers share it (``profile/ties.py``). With ``profile_cache`` each layer's
measurement is cached on its own key.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, ContextManager, Sequence

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.optimizer_step import measure_optimizer_ms
from lightning_dapple.profile.profiler import iter_tensors, map_tensors, profile_layers
from lightning_dapple.profile.ties import first_use_param_bytes, tied_params_records, tied_parameters
from lightning_dapple.strategy.optimizer_probe import optimizer_factory

__all__ = ["profile_one_layer_at_a_time"]


def _next_input(layer: nn.Module, x: Any, autocast_dtype: torch.dtype | None) -> Any:
    """The layer's output on ``x`` (what the next layer is profiled on), without autograd or
    a change to the random streams."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if autocast_dtype is None:
            out = layer(x)
        else:
            device = next((t.device.type for t in iter_tensors(x)), "cpu")
            with torch.autocast(device, dtype=autocast_dtype):
                out = layer(x)
    return map_tensors(out, lambda t: t.detach())


def profile_one_layer_at_a_time(
    layers: Sequence[nn.Module],
    sample: Any,
    real: Callable[[nn.Module], ContextManager[Any]],
    module: LightningModule,
    *,
    device: torch.device,
    cache_dir: str | None = None,
    name: str = "model",
    autocast_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """The profile of ``layers`` (on the meta device) on ``sample``, each layer made real by
    ``real(layer)`` only while it is measured (module docstring), with the run's optimizer
    step per layer in ``optimizer_ms`` (``strategy/optimizer_probe.py``)."""
    make, optimizer = optimizer_factory(module)
    parts: list[ModelProfile] = []
    stepped: list[float] = []
    x = sample
    for index, layer in enumerate(layers):
        with real(layer):
            part = profile_layers([layer], x, device=device, cache_dir=cache_dir, name=name, autocast_dtype=autocast_dtype)
            if make is not None:
                try:
                    stepped.append(measure_optimizer_ms([layer], make, device)[0])
                except Exception as exc:  # e.g. an optimizer whose step needs a closure
                    make, optimizer = None, f"not measured: {optimizer}.step() failed ({type(exc).__name__}: {exc})"
            x = _next_input(layer, x, autocast_dtype)
        parts.append(part)
    owned = first_use_param_bytes(layers)  # a tied parameter counts in its first layer
    measured = [
        replace(part.layers[0], name=f"{index} ({type(layer).__name__})", param_bytes=size, optimizer_ms=stepped[index] if make is not None else 0.0)
        for index, (part, layer, size) in enumerate(zip(parts, layers, owned))
    ]
    first = parts[0]
    meta = {**first.meta, "materialized": "one layer at a time (built on the meta device)", "optimizer": optimizer}
    return replace(first, layers=tuple(measured), tied=tied_params_records(tied_parameters(layers)), name=name, meta=meta)
