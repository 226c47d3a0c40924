"""Gradient accumulation across a step's micro-batches (``LayerProfile.accumulate_ms``):
measured per layer, charged by the simulator on every backward after a stage's first, and
spread over the backwards by DAPPLE's formula."""
from __future__ import annotations

import json
import pytest
import torch
from torch import nn

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import dapple_latency, stage_costs
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.plan.polish import _quick_latency
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.grad_accumulation import measure_accumulate_ms
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.simulate import simulate_plan

ACCUMULATE = 0.5


def _profile(accumulate: float = 0.0, split: bool = False) -> ModelProfile:
    """Four equal layers; with ``split`` their backward is 1 ms of input and 1 ms of weight gradients."""
    extra = {"backward_input_ms": 1.0, "backward_weight_ms": 1.0} if split else {}
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e4, 1e3, accumulate_ms=accumulate, **extra) for i in range(4))
    return ModelProfile(micro_batch_size=2, layers=layers, name="uniform", input_bytes=1e3)


def _plan(stages: int, micro_batches: int, schedule: str = "dapple", ooo: bool = False, devices: tuple[int, ...] | None = None) -> Plan:
    per = 4 // stages
    devices = devices or tuple(range(stages))
    return plan_from_dict({
        "global_batch_size": 2 * micro_batches, "micro_batches": micro_batches, "schedule": schedule, "ooo": ooo,
        "stages": [{"layers": [i * per, (i + 1) * per], "devices": [device]} for i, device in enumerate(devices)],
    })


# --------------------------------------------------------------------------- the measurement


def test_the_profile_times_an_add_over_the_trainable_parameters_only() -> None:
    cpu = torch.device("cpu")
    wide = nn.Linear(512, 512)
    assert measure_accumulate_ms(wide, cpu) > 0
    assert measure_accumulate_ms(nn.ReLU(), cpu) == 0.0
    frozen = nn.Linear(512, 512).requires_grad_(False)
    assert measure_accumulate_ms(frozen, cpu) == 0.0
    profile = profile_layers(nn.Sequential(nn.Linear(64, 64), nn.ReLU()), torch.randn(4, 64), repeats=3, warmup=1)
    assert profile.layers[0].accumulate_ms > 0 and profile.layers[1].accumulate_ms == 0.0


def test_a_tied_weight_is_counted_once_for_the_layers_sharing_it() -> None:
    """An embedding tied to a head has one ``.grad``: the second layer adds nothing of its own."""
    cpu = torch.device("cpu")
    embedding = nn.Embedding(4096, 256)
    head = nn.Linear(256, 4096, bias=False)
    head.weight = embedding.weight
    seen: set[int] = set()
    assert measure_accumulate_ms(embedding, cpu, seen=seen) > 0
    assert measure_accumulate_ms(head, cpu, seen=seen) == 0.0
    assert measure_accumulate_ms(head, cpu) > 0  # alone, the head's weight is its own


def test_profile_json_keeps_the_accumulation_and_leaves_it_out_when_none() -> None:
    data = json.loads(_profile(ACCUMULATE).to_json())
    assert all(layer["accumulate_ms"] == ACCUMULATE for layer in data["layers"])
    assert profile_from_dict(data) == _profile(ACCUMULATE)
    assert all("accumulate_ms" not in layer for layer in json.loads(_profile().to_json())["layers"])


# --------------------------------------------------------------------------- the simulator


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_one_stage_pays_an_accumulation_per_micro_batch_after_the_first(micro_batches: int) -> None:
    cluster, plan = Cluster(1, 1), _plan(1, micro_batches)
    grown = simulate_plan(plan, _profile(ACCUMULATE), cluster).latency_ms - simulate_plan(plan, _profile(), cluster).latency_ms
    assert grown == pytest.approx((micro_batches - 1) * 4 * ACCUMULATE)
    # DAPPLE's formula spreads the same total over the backwards
    costs = stage_costs(_profile(ACCUMULATE), cluster, plan.stages, plan.micro_batch_size)
    plain = stage_costs(_profile(), cluster, plan.stages, plan.micro_batch_size)
    formula_grown = dapple_latency(costs, micro_batches).latency_ms - dapple_latency(plain, micro_batches).latency_ms
    assert formula_grown == pytest.approx((micro_batches - 1) * 4 * ACCUMULATE)


@pytest.mark.parametrize(("schedule", "stages", "ooo"), [("dapple", 2, False), ("dapple", 2, True), ("zbv", 4, False)])
def test_every_stage_is_busier_by_its_accumulations(schedule: str, stages: int, ooo: bool) -> None:
    """Whether weight gradients come in B or in deferred W actions (ooo, ZB-V), each stage
    adds its layers' accumulation once per micro-batch after its first."""
    cluster = Cluster(1, 2)
    plan = _plan(stages, 4, schedule, ooo, (0, 1, 1, 0) if schedule == "zbv" else None)  # ZB-V: stage k on device k, then back
    with_accumulation = simulate_plan(plan, _profile(ACCUMULATE, split=True), cluster)
    without = simulate_plan(plan, _profile(0.0, split=True), cluster)
    layers_per_stage = 4 // stages
    for grown, base in zip(with_accumulation.stages, without.stages):
        assert grown.busy_ms - base.busy_ms == pytest.approx(3 * layers_per_stage * ACCUMULATE)


def test_the_planners_quick_pricing_adds_the_accumulation_as_the_formula_does() -> None:
    profile, cluster, plan = _profile(ACCUMULATE), Cluster(1, 2), _plan(2, 4)
    quick, _ = _quick_latency(RangeTables(profile), cluster, plan.stages, 2, plan.micro_batches, "PA", "dapple")
    assert quick == pytest.approx(dapple_latency(stage_costs(profile, cluster, plan.stages, 2), plan.micro_batches).latency_ms)
    plain, _ = _quick_latency(RangeTables(_profile()), cluster, plan.stages, 2, plan.micro_batches, "PA", "dapple")
    assert quick > plain
