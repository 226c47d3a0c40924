"""Chunk cuts of interleaved and V plans (plan/chunk_cut.py): every chunk non-empty, each
device group's work balanced first (exactly the best cut where all cuts can be listed),
chunks as even as possible within that, and a clear refusal when the layers run out."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.chunk_cut import chunk_placement, chunked_stages, cut_chunks, group_loads
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile


def _brute_force(weights: list[float], placement: tuple[int, ...], scale: list[float]) -> tuple[float, float]:
    """(largest group load, sum of squared chunk loads) of the best of all cuts."""
    n, best = len(weights), None
    for inner in itertools.combinations(range(1, n), len(placement) - 1):
        ends = [*inner, n]
        loads = group_loads(weights, ends, placement, scale)
        starts = [0, *ends[:-1]]
        squares = sum((math.fsum(weights[a:b]) * scale[g]) ** 2 for a, b, g in zip(starts, ends, placement))
        score = (max(loads), squares)
        best = score if best is None or score < best else best
    assert best is not None
    return best


def test_placements_follow_the_conventions() -> None:
    assert chunk_placement("interleaved", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert chunk_placement("interleaved", 2, 3) == (0, 1, 0, 1, 0, 1)
    assert chunk_placement("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    with pytest.raises(DappleConfigError, match="exactly 2 chunks"):
        chunk_placement("zbv", 4, 3)
    with pytest.raises(DappleConfigError, match="'dapple'"):
        chunk_placement("dapple", 4, 2)


def test_even_layers_give_even_chunks() -> None:
    for schedule, groups, chunks in (("interleaved", 2, 3), ("interleaved", 4, 2), ("zbv", 3, 2)):
        placement = chunk_placement(schedule, groups, chunks)
        ends = cut_chunks([1.0] * (2 * len(placement)), placement)
        assert ends == tuple(range(2, 2 * len(placement) + 1, 2))


def test_group_balance_matches_brute_force_on_random_costs() -> None:
    for seed in range(60):
        rng = random.Random(seed)
        schedule = rng.choice(("interleaved", "zbv"))
        groups, chunks = rng.choice((2, 3)), 2 if schedule == "zbv" else rng.choice((2, 3))
        placement = chunk_placement(schedule, groups, chunks)
        weights = [rng.uniform(0.5, 3.0) for _ in range(rng.randint(len(placement), 13))]
        scale = [rng.choice((1.0, 0.5)) for _ in range(groups)]
        ends = cut_chunks(weights, placement, scale)
        assert len(ends) == len(placement) and ends[-1] == len(weights)
        assert all(b > a for a, b in zip((0, *ends[:-1]), ends)), "every chunk holds a layer"
        best_max, _ = _brute_force(weights, placement, scale)
        assert max(group_loads(weights, ends, placement, scale)) == pytest.approx(best_max, rel=1e-12), seed


def test_within_balance_chunks_are_even() -> None:
    # two groups, 2 chunks: 8 layers of 1 ms balance groups either as 2+2 / 2+2 or as
    # 1+3 / 3+1; the even one is chosen
    placement = chunk_placement("interleaved", 2, 2)
    assert cut_chunks([1.0] * 8, placement) == (2, 4, 6, 8)
    # a heavy layer: group loads stay balanced (5 and 5), not chunk by chunk
    weights = [4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    ends = cut_chunks(weights, placement)
    assert group_loads(weights, ends, placement, [1.0, 1.0]) == [5.0, 5.0]


def test_large_instances_stay_near_the_ideal_quickly() -> None:
    rng = random.Random(7)
    weights = [rng.uniform(0.5, 3.0) for _ in range(96)]
    placement = chunk_placement("interleaved", 8, 3)
    ends = cut_chunks(weights, placement)
    ideal = math.fsum(weights) / 8
    assert max(group_loads(weights, ends, placement, [1.0] * 8)) <= ideal + max(weights) / 2


def test_replicated_groups_take_more_layers() -> None:
    # group 0 has 2 replicas (each runs half a micro-batch): it takes twice the layers
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e3, 1e3) for i in range(12))
    profile = ModelProfile(4, layers)
    stages = chunked_stages(profile, ((0, 1), (2,)), "interleaved", 2, 4)
    spans = [stage.end - stage.start for stage in stages]
    assert [stage.devices for stage in stages] == [(0, 1), (2,), (0, 1), (2,)]
    assert spans[0] + spans[2] == 8 and spans[1] + spans[3] == 4
    plan = Plan(8, 2, stages, schedule="interleaved").validate(num_layers=12, world_size=3)
    assert plan.chunks == 2


def test_too_few_layers_is_refused_with_the_fix() -> None:
    with pytest.raises(DappleConfigError) as error:
        cut_chunks([1.0] * 5, chunk_placement("interleaved", 3, 2))
    assert "6 stages (3 device groups x 2 chunks) need at least 6 layers, the model has 5" in str(error.value)
    assert "fewer chunks" in str(error.value)
