"""Plan options that need no schedule: out-of-order backprop on/off, fixed recomputation
modes, and the B/W split of profiles that do not measure it.

Out-of-order backprop (ooo-backprop sec. 3) splits each layer's backward into the
input-gradient half (B) and the weight-gradient half (W); the planner and the simulator
price the two halves from the profile, or from ``WEIGHT_SPLIT_ESTIMATE`` when the
profile has only whole backward times.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.plan import RECOMPUTE_MODES, ZERO_LEVELS, Plan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

__all__ = ["WEIGHT_SPLIT_ESTIMATE", "set_options", "with_weight_split"]

# Share of a parameterised layer's backward charged to W when a profile does not split
# it (PipeDream graph texts): for a GEMM/convolution, dX and dW are products of the same
# sizes, so each is about half of the backward. Layers without parameters have no W.
WEIGHT_SPLIT_ESTIMATE = 0.5


def with_weight_split(profile: ModelProfile, fraction: float = WEIGHT_SPLIT_ESTIMATE) -> ModelProfile:
    """``profile`` with every layer's B/W split filled in; measured splits are kept."""
    if all(layer.backward_input_ms is not None for layer in profile.layers):
        return profile
    layers = []
    for layer in profile.layers:
        if layer.backward_input_ms is not None:
            layers.append(layer)
            continue
        weight = layer.backward_ms * fraction if layer.param_bytes > 0 else 0.0
        layers.append(_split(layer, layer.backward_ms - weight, weight))
    meta = dict(profile.meta)
    meta["backward_split"] = f"estimated: W = {fraction:g} x backward of layers with parameters (no measured split)"
    return replace(profile, layers=tuple(layers), meta=meta)


def set_options(plan: Plan, *, ooo: bool | None = None, recompute: "str | Sequence[str] | None" = None, zero: int | None = None) -> Plan:
    """``plan`` with ``ooo``, fixed per-stage recomputation modes and a ZeRO level for every
    replicated stage set, without a profile (for ``"auto"``, which needs the memory model,
    use ``apply_ooo_recompute`` and the planner's ``zero="auto"``). ``None`` keeps what the
    plan says."""
    if recompute is not None:
        modes = [recompute] * plan.num_stages if isinstance(recompute, str) else list(recompute)
        require(len(modes) == plan.num_stages, "recompute", f"has {len(modes)} entries for {plan.num_stages} stages", "give one mode per stage or a single mode")
        for mode in modes:
            require(mode in RECOMPUTE_MODES, "recompute", f"is {mode!r} here", f"use one of {list(RECOMPUTE_MODES)}, or 'auto' with a profile (apply_ooo_recompute)")
        plan = replace(plan, stages=tuple(replace(stage, recompute=mode) for stage, mode in zip(plan.stages, modes)))
    if ooo is not None:
        plan = replace(plan, ooo=bool(ooo))
    if zero is not None:
        require(zero in ZERO_LEVELS and not isinstance(zero, bool), "zero", f"is {zero!r}", f"use one of {list(ZERO_LEVELS)}")
        plan = replace(plan, stages=tuple(replace(stage, zero=zero if stage.replicas > 1 else 0) for stage in plan.stages))
    return plan


def _split(layer: LayerProfile, input_ms: float, weight_ms: float) -> LayerProfile:
    return replace(layer, backward_input_ms=input_ms, backward_weight_ms=weight_ms)
