"""``ooo="auto"``: out-of-order backprop only where it pays, with the reason recorded; a
deferred W priced per layer of its stage; never on for a single stage."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dapple.cluster import CPU_LINKS, Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.profile.action_overhead import ActionOverhead
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.strategy.ooo_choice import DEFERRED_LAYER_MS, check_ooo, decide_ooo, deferred_layer_pricing, with_ooo_choice


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


# -- deferred weight gradients priced per layer of a stage ----------------------------------

DATA = Path(__file__).resolve().parent / "data"
OVERHEAD = ActionOverhead(forward=0.005, backward=0.009, backward_input=0.017, backward_weight=0.003, send=0.007, recv=0.019)


def _vgg_tiny_straight() -> tuple[ModelProfile, Plan]:
    """vgg_tiny's profile as a run measures it (its layers at 4 rows, the executor's
    overheads; ``tests/data/vgg_tiny_profile.json``) and the recipe's straight pipeline:
    4 single-process stages, M = 8 (``benchmarks/plans/straight_4x1_m8.json``), cut where
    the stages' compute is most even."""
    profile = profile_from_dict(json.loads((DATA / "vgg_tiny_profile.json").read_text()))
    cuts = ((0, 2), (2, 7), (7, 12), (12, 19))
    plan = plan_from_dict({"global_batch_size": 32, "micro_batches": 8, "stages": [{"layers": list(c), "devices": [i]} for i, c in enumerate(cuts)]})
    return profile, plan


def test_a_deferred_w_costs_its_stage_per_layer_with_weights() -> None:
    """Each W of a stage pays ``DEFERRED_LAYER_MS`` per layer with weight work it holds,
    whatever the slice; a profile without measured overheads is priced as it is."""
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 0.0 if i == 3 else 1e3, 1e4, backward_input_ms=1.0, backward_weight_ms=0.0 if i == 3 else 1.0)
        for i in range(6)
    )
    bare = ModelProfile(micro_batch_size=8, layers=layers, input_bytes=1e3)
    measured = replace(bare, action_overhead_ms=OVERHEAD)
    plan = plan_from_dict({"global_batch_size": 32, "micro_batches": 2, "stages": [
        {"layers": [0, 1], "devices": [0]}, {"layers": [1, 5], "devices": [1, 2]}, {"layers": [5, 6], "devices": [3]}]})
    assert deferred_layer_pricing(bare, plan) is bare
    before = stage_costs(measured, Cluster(1, 4), plan.stages, plan.micro_batch_size)
    after = stage_costs(deferred_layer_pricing(measured, plan), Cluster(1, 4), plan.stages, plan.micro_batch_size)
    weighted = [1, 3, 1]  # stage 1's layer 3 has no weight work
    for stage, (old, new) in enumerate(zip(before, after)):
        assert new.backward_weight_ms == pytest.approx(old.backward_weight_ms + weighted[stage] * DEFERRED_LAYER_MS), stage
        assert (new.backward_ms, new.backward_input_ms, new.forward_ms) == (old.backward_ms, old.backward_input_ms, old.forward_ms)


def test_auto_keeps_ooo_off_for_vgg_tiny_straight_even_with_a_core_per_process() -> None:
    """The straight pipeline measured slower with ooo (``benchmarks/README.md``,
    bench_ooo_choice): with its stages' 2-7 small layers each paying the deferred W per
    layer, auto stays off also where no cores are shared; priced per action only, as
    before, the simulator found ooo faster there."""
    profile, plan = _vgg_tiny_straight()
    own_cores = Cluster(1, 4, shared_cores=None, **CPU_LINKS)
    on, why = decide_ooo("auto", plan, profile, own_cores)
    assert on is False and "per layer" in why, why
    unpriced = simulate_plan(replace(plan, ooo=True), profile, own_cores).latency_ms
    assert unpriced < 0.99 * simulate_plan(plan, profile, own_cores).latency_ms  # what turned it on
    assert decide_ooo("auto", plan, profile, Cluster(1, 4, shared_cores=2, **CPU_LINKS))[0] is False


def test_auto_keeps_ooo_on_for_few_heavy_layers_with_measured_overheads() -> None:
    """bench_ooo's pipelines, measured faster with ooo (``benchmarks/README.md``): a few
    Linear(1024) layers of milliseconds each, whose per-layer deferral cost is noise."""
    layers = tuple(
        LayerProfile(f"l{i}", 1.5, 3.0, 5e5, 4e6, 1e6, backward_input_ms=1.5, backward_weight_ms=1.5) for i in range(8)
    )
    profile = ModelProfile(micro_batch_size=128, layers=layers, input_bytes=5e5, action_overhead_ms=OVERHEAD)
    for stages in (2, 4):
        per = 8 // stages
        plan = plan_from_dict({"global_batch_size": 512, "micro_batches": 4, "stages": [
            {"layers": [i * per, (i + 1) * per], "devices": [i]} for i in range(stages)]})
        on, why = decide_ooo("auto", plan, profile, Cluster(1, stages, shared_cores=None, **CPU_LINKS))
        assert on is True and "per layer" in why, (stages, why)


@pytest.mark.parametrize("devices", [[0], [0, 1], [0, 1, 2, 3]], ids=["one device", "2 replicas", "4 replicas"])
def test_auto_never_turns_ooo_on_for_a_single_stage(devices: list[int]) -> None:
    """One stage, replicated or not, has no bubble: off with or without a profile, even one
    whose W is as heavy as B and costs nothing to defer."""
    plan = plan_from_dict({"global_batch_size": 64, "micro_batches": 4, "stages": [{"layers": [0, 8], "devices": devices}]})
    heavy = _profile(1.0)
    for profile in (None, heavy, replace(heavy, action_overhead_ms=OVERHEAD)):
        on, why = decide_ooo("auto", plan, profile, Cluster(1, len(devices)) if profile is not None else None)
        assert on is False and "one stage" in why, why
