"""``ooo="auto"``: out-of-order backprop where it pays for this plan, and why.

Deferring weight gradients (ooo-backprop sec. 3, 5.2) pays in a pipeline: W fills the
warm-up and cool-down bubbles of the stages and the input gradient reaches the previous
stage sooner. A single stage has no bubble to fill, and there the split only adds work
(the deferred pairs are kept and revisited). So:

* with a profile (``plan="auto"``), the simulator prices the plan with and without
  out-of-order backprop (``simulate.memory_fit.apply_ooo_recompute``: deferral caps and
  reverse first-k chosen for the plan) and ooo is on when it is faster. On CPU processes
  that share fewer cores than they are, a bubble is another process's compute time, so
  the step is bound by the machine's compute (``simulate.cores``): ooo, whose split
  backward costs more than one backward (the profile's I + W against B), is then slower;
* the split also costs the executor per deferred layer, not per action: each layer with
  weight work routes its GEMM or convolution through the weight-gradient store in F, I
  and W (``execute/weight_grad.py``: a Python autograd function, the pair filed, a second
  kernel call in W). The profile times layers alone and the action-overhead probe one
  action on one small layer, so neither grows with the stage's layers.
  ``deferred_layer_pricing`` adds ``DEFERRED_LAYER_MS`` per such layer of a stage to that
  stage's W, for profiles that carry the executor's measured overheads (a profile without
  them prices no executor work at all). Measured (``benchmarks/bench_ooo.py
  --deferred-layers``, ``benchmarks/README.md``): beyond what profile and probe price,
  0.04 ms per small convolution layer and 0.008 ms per small linear layer, per
  micro-batch; a stage of 5 tiny VGG layers pays 0.3 ms per micro-batch, which in
  vgg_tiny's straight pipeline costs more than the bubbles its W fills;
* without one (an explicit plan), ooo is on when the plan has more than one stage; a
  single stage (replicated or not) has no bubble, and ooo stays off whatever is priced;
* a plan with several stages per device group is off: ZB-V splits every backward into I
  and W and places the W itself, and interleaved 1F1B has no deferred-W variant (the
  chunked schedules refuse ``ooo``, ``Plan.validate``).

The reason is kept in ``plan.extra["ooo_choice"]`` (the plan JSON) and printed with the
plan.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from lightning_dapple.errors import require
from lightning_dapple.plan.costs import slice_size
from lightning_dapple.plan.options import with_weight_split
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.memory_fit import apply_ooo_recompute

OooSetting = Literal["auto"] | bool

#: a simulated gain below this fraction is noise, not a reason to split the backward
MIN_GAIN = 0.01

#: the executor's cost of deferring one layer's weight gradient, per micro-batch, beyond
#: what the layer profile and the action-overhead probe price (module docstring; measured
#: with ``benchmarks/bench_ooo.py --deferred-layers``: a small convolution's cost, the
#: larger of the two kinds measured, which a transformer block's several linears reach)
DEFERRED_LAYER_MS = 0.04


def check_ooo(value: Any) -> OooSetting:
    """The user's ``ooo`` argument: True, False or "auto"."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        require(lowered == "auto", "ooo", f"is {value!r}", "use True, False or 'auto'")
        return "auto"
    require(isinstance(value, bool), "ooo", f"is {value!r}", "use True, False or 'auto'")
    return bool(value)


def decide_ooo(setting: OooSetting, plan: Plan, profile: Any = None, cluster: Any = None, recompute: Any = "never") -> tuple[bool, str]:
    """(ooo on?, why) for ``plan`` under the user's ``setting``."""
    if setting != "auto":
        return bool(setting), "as requested"
    if plan.num_stages == 1:
        return False, "auto: one stage has no pipeline bubble for deferred weight gradients to fill"
    if plan.chunks > 1:
        return False, f"auto: the {plan.schedule!r} schedule of several stages per device group places its own backward work"
    if profile is None or cluster is None:
        return True, f"auto: {plan.num_stages} stages; deferred weight gradients fill the pipeline bubbles (no profile to simulate)"
    times, bound = {}, False
    deferring = deferred_layer_pricing(profile, plan)
    for ooo in (False, True):
        used = deferring if ooo else profile
        priced = apply_ooo_recompute(plan, used, cluster, ooo=ooo, recompute=recompute)
        result = simulate_plan(priced, used, cluster)
        times[ooo], bound = result.latency_ms, bound or result.core_bound_ms == result.latency_ms
    on = times[True] < times[False] * (1 - MIN_GAIN)
    why = f"auto: simulated step {times[True]:.2f} ms with ooo, {times[False]:.2f} ms without"
    if deferring is not profile:
        why += f" (deferred weight gradients priced {DEFERRED_LAYER_MS:g} ms per layer of a stage)"
    if bound:  # simulate.cores: the shared cores, not the bubbles, set the step
        why += f" ({cluster.devices_per_machine} CPU processes share {cluster.shared_cores} cores: the step is their compute, which ooo's split backward adds to)"
    return on, why


def deferred_layer_pricing(profile: ModelProfile, plan: Plan, layer_ms: float | None = None) -> ModelProfile:
    """``profile`` (its B/W split filled in, ``plan.options.with_weight_split``) whose
    layers with weight work each add ``layer_ms`` to every W of ``plan``'s stage holding
    them (default ``DEFERRED_LAYER_MS``): a stage of L such layers pays L x ``layer_ms`` per
    deferred micro-batch (module docstring). A layer's times are per profile micro-batch and the cost model scales them
    to the stage's slice (``plan.costs.stage_costs``), so the fixed cost is divided by that
    scale here. A profile without the executor's measured overheads is returned as it is."""
    layer_ms = DEFERRED_LAYER_MS if layer_ms is None else layer_ms
    if profile.action_overhead_ms.is_zero or layer_ms <= 0:
        return profile
    split = with_weight_split(profile)
    layers = list(split.layers)
    for stage in plan.stages:
        scale = split.scale(slice_size(plan.micro_batch_size, stage.replicas))
        for index in range(stage.start, stage.end):
            layer = layers[index]
            if layer.weight_grad_ms > 0:
                layers[index] = replace(layer, backward_weight_ms=layer.weight_grad_ms + layer_ms / scale)
    return replace(split, layers=tuple(layers))


def with_ooo_choice(plan: Plan, on: bool, why: str) -> Plan:
    """``plan`` with ``ooo`` set and the reason recorded."""
    return replace(plan, ooo=on, extra={**plan.extra, "ooo_choice": f"{'on' if on else 'off'} ({why})"})
