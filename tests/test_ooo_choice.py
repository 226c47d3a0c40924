"""``ooo="auto"``: out-of-order backprop only where it pays, with the reason recorded."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.strategy.ooo_choice import check_ooo, decide_ooo, with_ooo_choice


def _plan(stages: int, micro_batches: int = 8) -> Plan:
    per = 8 // stages
    return plan_from_dict({
        "global_batch_size": 8 * micro_batches, "micro_batches": micro_batches,
        "stages": [{"layers": [i * per, (i + 1) * per], "devices": [i]} for i in range(stages)],
    })


def _profile(weight_ms: float) -> ModelProfile:
    """Eight equal layers whose backward is half input gradient, half ``weight_ms``."""
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 1.0 + weight_ms, 1e3, 1e3, 1e4, backward_input_ms=1.0, backward_weight_ms=weight_ms)
        for i in range(8)
    )
    return ModelProfile(micro_batch_size=8, layers=layers, name="uniform", input_bytes=1e3)


def test_check_ooo_accepts_three_values_and_names_them_otherwise() -> None:
    assert check_ooo(True) is True and check_ooo(False) is False
    assert check_ooo("auto") == "auto" and check_ooo("false") is False
    with pytest.raises(DappleConfigError, match="True, False or 'auto'"):
        check_ooo("sometimes")
    with pytest.raises(DappleConfigError, match="True, False or 'auto'"):
        check_ooo(1)


def test_auto_without_a_profile_follows_the_pipeline() -> None:
    assert decide_ooo("auto", _plan(1))[0] is False
    on, why = decide_ooo("auto", _plan(4))
    assert on is True and "4 stages" in why
    assert decide_ooo(False, _plan(4)) == (False, "as requested")
    plan = with_ooo_choice(_plan(4), False, "as requested")
    assert plan.ooo is False and plan.extra["ooo_choice"] == "off (as requested)"


def test_auto_with_a_profile_takes_the_simulators_answer() -> None:
    cluster = Cluster(1, 4)
    heavy = _profile(1.0)  # W as heavy as B: deferring it fills the bubbles of 4 stages
    on, why = decide_ooo("auto", _plan(4), heavy, cluster)
    with_ooo = simulate_plan(replace(_plan(4), ooo=True), heavy, cluster).latency_ms
    without = simulate_plan(_plan(4), heavy, cluster).latency_ms
    assert on is (with_ooo < 0.99 * without), why
    assert on is True and "simulated step" in why
    # one stage: the rule needs no simulation, and ooo stays off
    assert decide_ooo("auto", _plan(1), heavy, cluster)[0] is False
