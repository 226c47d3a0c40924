"""What adding a layer's gradients into existing ones costs: ``LayerProfile.accumulate_ms``.

The profiler (PipeDream 3.2) times a layer's backward with ``torch.autograd.grad``, which
accumulates nothing. A training step of M micro-batches runs M backwards into the same
``.grad`` tensors: the first takes the new gradient as it is (autograd's AccumulateGrad
steals it), every later one adds into it in place, a pass over the layer's parameters that a
step of one micro-batch never makes (``benchmarks/bench_grad_accumulation.py`` measures it
against a stage's profile). This module times that add on the layer's own trainable
parameters, on the profiling device: one ``add_`` per parameter, as AccumulateGrad issues
them, on buffers of the parameters' sizes and dtypes. A layer larger than
``ACCUMULATE_CAP_ELEMENTS`` per dtype is timed on that many elements and scaled by its size
(the add is bound by memory bandwidth). Frozen parameters get no gradient and cost nothing;
a parameter several layers share (a tied weight) is counted in the first of them only.
"""
from __future__ import annotations

import torch
from torch import nn

from lightning_dapple.profile.timing import median_ms

__all__ = ["ACCUMULATE_CAP_ELEMENTS", "measure_accumulate_ms"]

ACCUMULATE_CAP_ELEMENTS = 1 << 25  # 32 Mi elements per dtype: 128 MiB of float32, twice over


def measure_accumulate_ms(layer: nn.Module, device: torch.device, repeats: int = 5, warmup: int = 2, seen: set[int] | None = None) -> float:
    """Milliseconds of one accumulation of ``layer``'s parameter gradients (module docstring):
    the median of ``repeats`` timed passes after ``warmup``; 0 for a layer with no trainable
    parameter. ``seen``: ids of parameters an earlier layer already counts (a weight tied
    between layers has one ``.grad``, added into once per backward), updated with this
    layer's."""
    seen = set() if seen is None else seen
    sizes: dict[torch.dtype, list[int]] = {}
    for param in layer.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            sizes.setdefault(param.dtype, []).append(param.numel())
    total_ms = 0.0
    for dtype, numels in sizes.items():
        whole = sum(numels)
        if whole == 0:
            continue
        # one add per parameter, on views of two flat buffers; over the cap each view shrinks
        # in proportion, so every parameter keeps its own call
        pieces = numels if whole <= ACCUMULATE_CAP_ELEMENTS else [max(1, numel * ACCUMULATE_CAP_ELEMENTS // whole) for numel in numels]
        timed = sum(pieces)
        into = torch.zeros(timed, dtype=dtype, device=device)
        new = torch.zeros_like(into)
        bounds = [0]
        for piece in pieces:
            bounds.append(bounds[-1] + piece)
        pairs = [(into[a:b], new[a:b]) for a, b in zip(bounds, bounds[1:])]

        def accumulate() -> None:
            for grad, more in pairs:
                grad.add_(more)

        total_ms += median_ms(device, accumulate, repeats, warmup) * whole / timed
    return total_ms
