"""The search's shortcuts are exact (not timed; benchmarks/bench_planner_speed.py times it):
a transfer unit memoised by the machines of disjoint senders and receivers equals the unit
priced on the ranks themselves, and the per-start ``t_max`` table equals ``t_max`` of the
stage [j, J) priced on its own."""
from __future__ import annotations

import random

import numpy as np
import pytest

from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.plan.search import SearchSettings, SharedMemo, StageSearch
from lightning_dapple.plan.search_tables import RangeTables, p2p_ms_fast
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile


def _profile(n: int = 12) -> ModelProfile:
    """Uneven layers whose weights and stash reach the 16 GiB device limit within a few layers."""
    sizes = [(1.0 + i % 3, 2e6 * (1 + i % 4), 1e9 * (1 + i % 5), 5e8 * (1 + i % 2)) for i in range(n)]
    return ModelProfile(4, tuple(LayerProfile(f"layer{i}", f, 2 * f, out, params, stash) for i, (f, out, params, stash) in enumerate(sizes)), name="speed-check")


def _search(cluster: Cluster, policy: str = "PA", schedule: str = "dapple", micro_batches: int = 4) -> StageSearch:
    settings = SearchSettings(policy, schedule, keep_per_state=2)
    return StageSearch(RangeTables(_profile()), cluster, 64, micro_batches, 1, settings, SharedMemo())


@pytest.mark.parametrize("name", ["paper-a", "8x8", "paper-c"])
def test_transfer_unit_by_machines_equals_the_unit_on_the_ranks(name: str) -> None:
    cluster = load_cluster(name) if name != "8x8" else Cluster(8, 8)
    search = _search(cluster)
    rng = random.Random(0)
    g, probe = cluster.num_devices, 1e6
    checked = 0
    for _ in range(3000):
        ranks = rng.sample(range(g), rng.randint(2, g))
        cut = rng.randint(1, len(ranks) - 1)
        senders, receivers = tuple(sorted(ranks[:cut])), tuple(sorted(ranks[cut:]))
        unit, _ = search.p2p_unit(senders, receivers)  # often answered from the memo
        exact = (p2p_ms_fast(cluster, probe, senders, receivers) - cluster.latency_ms) / probe
        assert unit == exact, (senders, receivers)
        checked += 1
    # the memo was shared between different rank sets, so the equality above is not trivial
    assert len(search.shared.p2p) < checked


@pytest.mark.parametrize("policy,schedule", [("PA", "dapple"), ("PB", "dapple"), ("PA", "gpipe")])
def test_tmax_rows_equal_tmax_of_each_stage(policy: str, schedule: str) -> None:
    cluster = Cluster(2, 4, device_memory_gib=16.0)
    search = _search(cluster, policy, schedule)
    t = search.t
    seen = set()
    replicas = np.array([3, 1, cluster.num_devices, 3, 2] + list(range(1, cluster.num_devices + 1)))
    for j in range(t.n):
        table = np.full((cluster.num_devices + 1, t.n + 1), np.nan)
        table[replicas, j + 1 :] = search.tmax_rows(j, replicas, j + 1, t.n + 1)
        for r in range(1, cluster.num_devices + 1):
            ends = slice(j + 1, t.n + 1)
            direct = search.t_max(t.params[j, ends][None, :] * search.weight_factor, t.stash[j, ends][None, :] * search.scale(r))[0]
            np.testing.assert_array_equal(table[r, j + 1 :], direct)
            seen.update(direct.tolist())
    # the memory limit binds somewhere: the comparison covers stages that always fit and
    # stages that fit only up to a finite number of stages after them (or never)
    assert np.inf in seen and len(seen) >= 2


def test_balanced_cuts_minimise_the_slowest_stage() -> None:
    """The bottleneck DP of ``baselines._balanced_cuts`` finds the best cut of all (checked
    against every cut): the slowest stage or twice a transfer, as PipeDream 3.2 balances."""
    import itertools

    from lightning_dapple.plan.baselines import _balanced_cuts
    from lightning_dapple.plan.costs import slice_size

    rng = random.Random(3)
    cluster = Cluster(2, 2, inter_bandwidth_gbps=10.0)
    checked = 0
    for _ in range(40):
        n = rng.randint(2, 7)
        layers = tuple(LayerProfile(f"l{i}", rng.uniform(0.5, 4.0), rng.uniform(1.0, 8.0), rng.uniform(1e5, 5e7), 1e6, 1e6) for i in range(n))
        tables = RangeTables(ModelProfile(2, layers, name="cuts"))
        count = rng.randint(1, min(n, cluster.num_devices))
        ranks = rng.sample(range(cluster.num_devices), cluster.num_devices)
        sizes = [1] * count
        for _ in range(rng.randint(0, cluster.num_devices - count)):
            sizes[rng.randrange(count)] += 1  # replicated stages run smaller slices
        devices = [tuple(sorted(ranks[sum(sizes[:s]) : sum(sizes[: s + 1])])) for s in range(count)]
        mbs = rng.choice([2, 4])

        def slowest(cuts: list[int]) -> float:
            worst = 0.0
            for s in range(count):
                a, b = cuts[s], cuts[s + 1]
                worst = max(worst, float(tables.work[a, b]) * slice_size(mbs, len(devices[s])) / 2)
                if s + 1 < count:
                    unit = p2p_ms_fast(cluster, 1e6, devices[s], devices[s + 1]) / 1e6  # ms per byte, as the DP prices a send
                    worst = max(worst, 2.0 * float(tables.output[b - 1]) * mbs / 2 * unit)
            return worst

        found = _balanced_cuts(tables, cluster, devices, mbs)
        assert found is not None and found[0] == 0 and found[-1] == n and all(a < b for a, b in zip(found, found[1:]))
        best = min(slowest([0, *inner, n]) for inner in itertools.combinations(range(1, n), count - 1))
        assert slowest(found) == pytest.approx(best, rel=1e-9)
        checked += 1
    assert checked == 40
