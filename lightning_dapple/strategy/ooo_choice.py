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
* without one (an explicit plan), ooo is on when the plan has more than one stage;
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
from lightning_dapple.plan.plan import Plan
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.memory_fit import apply_ooo_recompute

OooSetting = Literal["auto"] | bool

#: a simulated gain below this fraction is noise, not a reason to split the backward
MIN_GAIN = 0.01


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
    for ooo in (False, True):
        priced = apply_ooo_recompute(plan, profile, cluster, ooo=ooo, recompute=recompute)
        result = simulate_plan(priced, profile, cluster)
        times[ooo], bound = result.latency_ms, bound or result.core_bound_ms == result.latency_ms
    on = times[True] < times[False] * (1 - MIN_GAIN)
    why = f"auto: simulated step {times[True]:.2f} ms with ooo, {times[False]:.2f} ms without"
    if bound:  # simulate.cores: the shared cores, not the bubbles, set the step
        why += f" ({cluster.devices_per_machine} CPU processes share {cluster.shared_cores} cores: the step is their compute, which ooo's split backward adds to)"
    return on, why


def with_ooo_choice(plan: Plan, on: bool, why: str) -> Plan:
    """``plan`` with ``ooo`` set and the reason recorded."""
    return replace(plan, ooo=on, extra={**plan.extra, "ooo_choice": f"{'on' if on else 'off'} ({why})"})
