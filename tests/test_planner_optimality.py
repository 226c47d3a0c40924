"""The DAPPLE planner against brute force (DAPPLE 4.3, formulas 4-5 and Algorithm 1).

Small random instances -- up to 8 layers, up to 2 machines x 4 devices (and flat clusters of
4 or 8 one-device machines, configs B/C of the paper), random per-layer times and sizes,
random link speeds, device memory and global batch -- are planned by ``dapple_search`` and by
``enumerate_best``, which scores every partition, replication and placement with the same
cost model. The planner must find the exhaustive optimum on >= 95% of instances and be
within 5% on all. The paper's own DP (one plan per sub-problem, its three placement policies)
does not always: ``test_paper_dp_misses_what_the_pareto_sets_find`` pins one such case.
"""
from __future__ import annotations

import math
import random

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import pipeline_phases
from lightning_dapple.plan.dapple_planner import dapple_search, lower_bound
from lightning_dapple.plan.enumerate import enumerate_best
from lightning_dapple.plan.evaluate import score_stages
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.fidelity import random_instance


def test_planner_matches_exhaustive_search_on_random_instances() -> None:
    rng = random.Random(20240601)
    instances = 240
    exact = 0
    compared = 0
    worst = 1.0
    misses = []
    for index in range(instances):
        profile, cluster, gbs, m = random_instance(rng)
        best = enumerate_best(profile, cluster, gbs, m, min_slice=1)
        found = dapple_search(profile, cluster, gbs, m, min_slice=1)
        if best.best is None:
            assert not found, f"instance {index}: planner found a plan where brute force found none"
            continue
        assert found, f"instance {index}: brute force found {best.latency_ms:.3f} ms, the planner nothing"
        compared += 1
        ratio = found[0].latency_ms / best.latency_ms
        assert ratio >= 1 - 1e-9, f"instance {index}: planner beat brute force ({ratio})"
        if ratio <= 1 + 1e-9:
            exact += 1
        else:
            misses.append((index, ratio))
        worst = max(worst, ratio)
    assert compared >= 200
    assert exact >= 0.95 * compared, f"exact on {exact}/{compared}; misses {misses}"
    assert worst <= 1.05, f"worst ratio {worst:.4f}; misses {misses}"


# A flat cluster (8 machines of one device: placement cannot matter) where the paper's DP,
# keeping one plan per sub-problem T_PL(j, m, g) ranked by its latency with the rest as
# one stage, settles a 3-stage prefix too early: the cut 2:3|3:6 looks better than 2:4|4:6
# while layers 3.. are still one stage, but once they are split the second is 18% faster.
CASE_LAYERS = [
    ("l0", 8.252454484498763, 8.553378304471975, 100000.0, 0, 1000000.0),
    ("l1", 7.847511872974951, 13.643927868767426, 50000000.0, 0, 100000000.0),
    ("l2", 0.9714187764018434, 2.7370647254552076, 1000000.0, 500000000.0, 1000000.0),
    ("l3", 2.333554240773699, 5.006799782134867, 1000000.0, 10000000.0, 100000000.0),
    ("l4", 2.54132470426534, 3.2299628980490622, 100000.0, 10000000.0, 1000000.0),
    ("l5", 5.678491496591617, 12.79938955773018, 50000000.0, 0, 100000000.0),
    ("l6", 5.045053889184105, 5.176731908458256, 10000000.0, 500000000.0, 10000000.0),
]


def test_paper_dp_misses_what_the_pareto_sets_find() -> None:
    profile = ModelProfile(4, tuple(LayerProfile(*fields) for fields in CASE_LAYERS))
    cluster = Cluster(8, 1, intra_bandwidth_gbps=300, inter_bandwidth_gbps=100, device_memory_gib=4)
    optimum = enumerate_best(profile, cluster, 32, min_slice=1)
    paper = dapple_search(profile, cluster, 32, min_slice=1, keep=1, keep_per_state=1, extended_placement=False, beam=None)[0]
    ours = dapple_search(profile, cluster, 32, min_slice=1)[0]
    assert [s.layers for s in paper.stages] == [(0, 1), (1, 2), (2, 3), (3, 6), (6, 7)]
    assert paper.latency_ms > 1.2 * optimum.latency_ms
    assert math.isclose(ours.latency_ms, optimum.latency_ms, rel_tol=1e-9)
    assert [s.layers for s in ours.stages] == [(0, 1), (1, 2), (2, 4), (4, 6), (6, 7)]
    # two candidates per sub-problem are already enough here
    two = dapple_search(profile, cluster, 32, min_slice=1, keep_per_state=2, extended_placement=False, beam=None)[0]
    assert math.isclose(two.latency_ms, optimum.latency_ms, rel_tol=1e-9)


def test_lower_bound_holds_for_random_plans() -> None:
    """``lower_bound`` (what the branch and bound prunes with) never exceeds formula 2."""
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        profile, cluster, gbs, _ = random_instance(rng)
        n, g = profile.num_layers, cluster.num_devices
        count = rng.randint(1, min(n, g))
        cuts = sorted(rng.sample(range(1, n), count - 1))
        bounds = [0, *cuts, n]
        sizes = [1] * count
        for _ in range(g - count):
            sizes[rng.randrange(count)] += 1
        ranks = list(range(g))
        rng.shuffle(ranks)
        stages, at = [], 0
        for s in range(count):
            stages.append(StagePlan((bounds[s], bounds[s + 1]), tuple(sorted(ranks[at : at + sizes[s]]))))
            at += sizes[s]
        m = rng.choice([d for d in (1, 2, 4, 8) if gbs % d == 0])
        if (gbs // m) < max(sizes):
            continue
        scored = score_stages(profile, cluster, stages, gbs, m)
        whole = (gbs // m) / profile.micro_batch_size
        for k in range(1, count):
            prefix = pipeline_phases(scored.costs[:k])
            # the prefix's phases: its stages and the transfers between them
            fb = [f + b for f, b, _ in prefix]
            work = sum(layer.forward_ms + layer.backward_ms for layer in profile.layers[bounds[k]:]) * whole
            bound = lower_bound(m, max(fb), sum(fb), work, g - sum(sizes[:k]))
            assert bound <= scored.latency_ms * (1 + 1e-9), (stages, m, k, bound, scored.latency_ms)
            checked += 1
    assert checked > 300


def test_enumerator_pruning_changes_nothing() -> None:
    rng = random.Random(11)
    for _ in range(25):
        profile, cluster, gbs, m = random_instance(rng)
        if profile.num_layers > 5 or cluster.num_devices > 4:
            continue
        pruned = enumerate_best(profile, cluster, gbs, m, min_slice=1)
        full = enumerate_best(profile, cluster, gbs, m, min_slice=1, prune=False)
        assert math.isclose(pruned.latency_ms, full.latency_ms, rel_tol=1e-12) or pruned.latency_ms == full.latency_ms
        if full.best is not None:
            again = score_stages(profile, cluster, full.best.stages, gbs, full.best.micro_batches)
            assert math.isclose(again.latency_ms, full.latency_ms, rel_tol=1e-9)
