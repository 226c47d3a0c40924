"""Gradient AllReduce overlapped with the backward (DDP-style buckets): the cost model, the
search's vectorised tables and the simulator charge the same exposed tail."""
from __future__ import annotations

import random

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.buckets import bucket_layers
from lightning_dapple.plan.costs import dapple_latency, exposed_tail, stage_costs
from lightning_dapple.plan.overlap import OverlapTables
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate import simulate_plan

MIB = 2**20


def test_exposed_tail_by_hand() -> None:
    # three buckets: ready 6 ms and 2 ms before the backward ends, and at its end
    # ready at -6, -2 and 0 ms (backward ends at 0): runs -6..-3, -2..1, 1..2
    assert exposed_tail([(6.0, 3.0), (2.0, 3.0), (0.0, 1.0)]) == pytest.approx(2.0)
    assert exposed_tail([(10.0, 1.0), (5.0, 1.0)]) == pytest.approx(0.0)  # all hidden by the backward
    assert exposed_tail([]) == 0.0


def test_tables_match_the_per_stage_formula() -> None:
    rng = random.Random(3)
    for _ in range(100):
        n = rng.randint(1, 10)
        params = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)]
        backward = [rng.random() for _ in range(n)]
        cap = rng.randint(1, 10)
        a, latency, s = rng.random(), rng.choice([0.0, 0.2]), rng.uniform(0.1, 3.0)
        table = OverlapTables(params, backward, cap).tail(a, latency, s)
        for j in range(n):
            for end in range(j + 1, n + 1):
                buckets = []
                for lo, hi in bucket_layers(params, j, end, cap):
                    size = sum(params[lo:hi])
                    buckets.append((s * sum(backward[j:lo]), a * size + latency if size > 0 else 0.0))
                assert table[j, end] == pytest.approx(exposed_tail(buckets), abs=1e-9)


def _model(n: int = 8) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", 10.0, 20.0, 1e6, 30 * MIB, 1e6) for i in range(n))
    return ModelProfile(1, layers, name="uniform")


@pytest.mark.parametrize("replicas, machines", [(4, 4), (8, 2)])
def test_simulator_charges_the_formulas_tail(replicas: int, machines: int) -> None:
    profile = _model()
    cluster = Cluster(machines, replicas // machines, inter_bandwidth_gbps=10.0)
    plan = Plan(global_batch_size=replicas * 2, micro_batches=2, stages=(StagePlan((0, 8), tuple(range(replicas))),))
    (cost,) = stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)
    assert len(cost.buckets) == 8  # one 30 MiB layer per bucket (above DDP's 25 MiB)
    assert 0 < cost.exposed_allreduce_ms < cost.allreduce_ms
    formula = dapple_latency([cost], plan.micro_batches).latency_ms
    assert formula == pytest.approx(2 * cost.compute_ms + cost.exposed_allreduce_ms)
    assert simulate_plan(plan, profile, cluster).latency_ms == pytest.approx(formula)


def test_a_pipeline_stage_overlaps_only_its_last_backward() -> None:
    profile = _model()
    cluster = Cluster(2, 2, inter_bandwidth_gbps=10.0, intra_bandwidth_gbps=10.0)
    plan = Plan(global_batch_size=8, micro_batches=4, stages=(StagePlan((0, 4), (0, 1)), StagePlan((4, 8), (2, 3))))
    costs = stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)
    sim = simulate_plan(plan, profile, cluster)
    # the first stage's last backward ends last; its exposed tail is what follows it
    last_b = max(span.end_ms for span in sim.stages[0].spans if span.kind == "B")
    assert sim.latency_ms == pytest.approx(last_b + costs[0].exposed_allreduce_ms)
    buckets = sim.transfers["AR0"]
    assert len(buckets) == 4 and all(b.start_ms >= a.end_ms - 1e-9 for a, b in zip(buckets, buckets[1:]))
    assert buckets[0].start_ms < last_b  # the first bucket runs during the backward
