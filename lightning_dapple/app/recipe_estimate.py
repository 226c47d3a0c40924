"""A FLOP/byte estimate of each layer of a recipe's model, for planning without its hardware.

Each layer of the model (built on the meta device, so nothing is allocated) runs once under
``FlopCounterMode``; its time is the larger of its FLOPs at the device's peak and the bytes
it moves at the device's memory bandwidth (a roofline), backward twice the forward. The
result is a ``ModelProfile`` marked ``estimated`` that the planner reads like a measured
one (DAPPLE 4.1 needs per-layer times, activation and parameter sizes).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_dapple.app.devices import DevicePeak
from lightning_dapple.models import MODELS
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.profile.profiler import iter_tensors, map_tensors, tensor_bytes
from lightning_dapple.profile.ties import first_use_param_bytes, tied_params_records, tied_parameters

__all__ = ["estimate_profile"]


def estimate_profile(model_name: str, model_kwargs: dict[str, Any], rows: int, device: DevicePeak, precision: str = "fp32", name: str = "estimate") -> ModelProfile:
    """FLOP/byte estimate of every layer of ``MODELS[model_name](**model_kwargs)`` on ``device``."""
    dtype = torch.float16 if precision == "fp16" else torch.float32
    peak = 1e12 * (device.fp16_tflops if precision == "fp16" else device.fp32_tflops)  # FLOP/s
    bandwidth = 1e9 * device.memory_bandwidth_gbs  # B/s
    with torch.device("meta"):
        model = MODELS[model_name](**model_kwargs).to(dtype)
    example = model.example_input_array

    def widen(t: torch.Tensor) -> torch.Tensor:
        t = t.to("meta")
        t = t[:1].expand(rows, *t.shape[1:]).contiguous()
        return t.to(dtype) if t.is_floating_point() else t

    x = map_tensors(example, widen) if not isinstance(example, torch.Tensor) else widen(example)
    input_bytes = float(tensor_bytes(x))
    layers: list[LayerProfile] = []
    owned = first_use_param_bytes(model.layers)  # a tied parameter counts in its first layer
    for index, layer in enumerate(model.layers):
        params = list(layer.parameters())
        param_ids = {id(p) for p in params}
        param_bytes = owned[index]
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in param_ids and not (t._base is not None and id(t._base) in param_ids):
                saved[id(t)] = t.numel() * t.element_size()
            return t

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().requires_grad_(True) if t.is_floating_point() else t

        xin = map_tensors(x, leaf)
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(xin)
        flops = float(counter.get_total_flops())
        in_bytes = float(tensor_bytes(x))
        out_bytes = float(tensor_bytes(out))
        stash = float(sum(saved.values()))
        moved = float(sum(p.numel() * p.element_size() for p in params)) + in_bytes + out_bytes + stash  # tied ones are read too
        forward_s = max(flops / peak, moved / bandwidth)
        backward_s = max(2.0 * flops / peak, 2.0 * moved / bandwidth) if (params or any(t.requires_grad for t in iter_tensors(out))) else 0.0
        layers.append(
            LayerProfile(
                name=f"{index} ({type(layer).__name__})",
                forward_ms=1e3 * forward_s,
                backward_ms=1e3 * backward_s,
                output_bytes=out_bytes,
                param_bytes=param_bytes,
                stash_bytes=stash,
            )
        )
        x = map_tensors(out, lambda t: t.detach())
    return ModelProfile(
        micro_batch_size=rows,
        layers=tuple(layers),
        device=f"{device.name} (estimate)",
        name=name,
        input_bytes=input_bytes,
        estimated=True,
        tied=tied_params_records(tied_parameters(model.layers)),
        meta={
            "source": "lightning_dapple.app.recipe_estimate.estimate_profile",
            "rule": "time = max(flops / peak, bytes / bandwidth); backward = 2 x forward",
            "peak_tflops": peak / 1e12,
            "memory_bandwidth_gbs": device.memory_bandwidth_gbs,
            "precision": precision,
            "model": model_name,
            "model_kwargs": model_kwargs,
        },
    )
