"""Plans given by their shape (stages with devices and no layers): the planner cuts the
layers (``plan/shape_plan.py``), and bad shapes are named before any planning."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan, PlanShape, plan_or_shape_from_dict
from lightning_dapple.plan.shape_plan import plan_shape
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.strategy.resolve import PlanArguments, shape_with_arguments

TWO = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}


def _profile(forward_ms: list[float]) -> ModelProfile:
    layers = tuple(LayerProfile(f"layer{i}", f, 2 * f, 1e3, 1e4, 1e4) for i, f in enumerate(forward_ms))
    return ModelProfile(micro_batch_size=4, layers=layers, name="uneven", input_bytes=1e3)


def test_stages_without_layers_are_a_shape_and_half_given_layers_are_refused() -> None:
    shape = plan_or_shape_from_dict(TWO)
    assert isinstance(shape, PlanShape) and shape.devices == ((0,), (1,)) and shape.micro_batches == 2
    assert isinstance(plan_or_shape_from_dict({**TWO, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 3], "devices": [1]}]}), Plan)
    with pytest.raises(DappleConfigError, match=r"stages\[1\].layers: is missing while other stages give theirs"):
        plan_or_shape_from_dict({**TWO, "stages": [{"layers": [0, 1], "devices": [0]}, {"devices": [1]}]})
    with pytest.raises(DappleConfigError, match="runs one stage per device group"):
        plan_or_shape_from_dict({**TWO, "stages": [{"devices": [0]}, {"devices": [0]}]})
    with pytest.raises(DappleConfigError, match="micro_bat"):
        plan_or_shape_from_dict({**TWO, "micro_batch": 2})  # a misspelled key is named, as in plans


def test_the_cut_minimises_the_slowest_stage() -> None:
    """Layers of 1, 1, 1 and 5 ms on two stages: the last layer alone, the rest before it."""
    plan = plan_shape(_profile([1.0, 1.0, 1.0, 5.0]), Cluster(1, 2), plan_or_shape_from_dict(TWO))
    assert [stage.layers for stage in plan.stages] == [(0, 3), (3, 4)] and plan.planner == "dapple-shape"
    assert plan.micro_batches == 2 and [stage.warmup for stage in plan.stages] == [2, 1]  # K_i filled (DAPPLE 5.3)


def test_the_planner_chooses_m_when_the_shape_leaves_it_open_and_arguments_win() -> None:
    profile, cluster = _profile([2.0] * 6), Cluster(1, 4)
    open_shape = plan_or_shape_from_dict({"global_batch_size": 8, "stages": [{"devices": [0, 1]}, {"devices": [2, 3]}]})
    plan = plan_shape(profile, cluster, open_shape)
    assert [stage.devices for stage in plan.stages] == [(0, 1), (2, 3)]
    by_m = {m: plan_shape(profile, cluster, replace(open_shape, micro_batches=m)).predicted.latency_ms for m in (1, 2, 4)}  # slices of >= 2 rows
    assert plan.predicted.latency_ms == min(by_m.values()) and len(set(by_m.values())) > 1  # the fastest M, and M mattered
    fixed = shape_with_arguments(open_shape, PlanArguments(micro_batches=4, schedule="gpipe", recompute="always"))
    plan = plan_shape(profile, cluster, fixed)
    assert (plan.micro_batches, plan.schedule) == (4, "gpipe") and {stage.recompute for stage in plan.stages} == {"always"}


@pytest.mark.parametrize(
    ("stages", "layers", "match"),
    [(3, 2, "ask for 3 stages but the model has 2 layers"), (2, 4, None)],
)
def test_more_stages_than_layers_is_named(stages: int, layers: int, match: str | None) -> None:
    shape = plan_or_shape_from_dict({"global_batch_size": 8, "stages": [{"devices": [i]} for i in range(stages)]})
    if match is None:
        assert plan_shape(_profile([1.0] * layers), Cluster(1, stages), shape).num_stages == stages
        return
    with pytest.raises(DappleConfigError, match=match):
        plan_shape(_profile([1.0] * layers), Cluster(1, stages), shape)


def test_the_three_stage_cut_is_the_best_over_every_cut() -> None:
    """The cut found for three stages is the best of all cuts under the bottleneck the
    planner minimises (compute per stage), over every possible cut of 7 layers."""
    times = [1.0, 3.0, 2.0, 2.0, 4.0, 1.0, 2.0]
    profile, cluster = _profile(times), Cluster(1, 3)
    shape = plan_or_shape_from_dict({"global_batch_size": 8, "micro_batches": 4, "stages": [{"devices": [i]} for i in range(3)]})
    plan = plan_shape(profile, cluster, shape)
    got = max(sum(times[s.start : s.end]) for s in plan.stages)
    best = min(max(sum(times[:a]), sum(times[a:b]), sum(times[b:])) for a, b in itertools.combinations(range(1, 7), 2))
    assert got == best
