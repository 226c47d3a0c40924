"""The plans the planner always compares against: data parallelism, the straight pipeline,
and any candidate's evenly balanced twin (DAPPLE 6.2 compares its plans with DP and the
straight pipeline; PipeDream 3.2's bottleneck objective balances the cuts).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import slice_size
from lightning_dapple.plan.evaluate import Scored
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.search import SearchSettings, StageSearch
from lightning_dapple.plan.search_tables import RangeTables, p2p_ms_fast

__all__ = ["balanced_variant", "data_parallel_candidates", "shape_candidates", "smallest_memory", "straight_candidates"]

_INF = float("inf")


def _balanced_cuts(tables: RangeTables, cluster: Cluster, devices: Sequence[tuple[int, ...]], mbs: int) -> list[int] | None:
    """Layer cuts for stages on ``devices`` (in order) that minimise the slowest stage: the
    max over stages of F+B and of twice the transfer to the next stage (PipeDream 3.2's
    objective for a fixed replication), by a bottleneck DP over cut positions."""
    count = len(devices)
    n = tables.n
    if count > n:
        return None
    whole = mbs / tables.pbs
    best = np.full(n + 1, _INF)
    best[0] = 0.0
    choice = np.zeros((count, n + 1), dtype=int)
    starts = np.arange(n + 1)[:, None]
    for s in range(count):
        scale = slice_size(mbs, len(devices[s])) / tables.pbs
        last = s + 1 == count
        ends = np.array([n]) if last else np.arange(s + 1, n - (count - s - 1) + 1)
        # value[start, c]: the slowest stage so far if this stage is [start, c)
        value = np.maximum(best[:, None], tables.work[:, ends] * scale)
        if not last:
            unit = p2p_ms_fast(cluster, 1e6, devices[s], devices[s + 1]) / 1e6
            value = np.maximum(value, (2.0 * tables.cut_bytes(ends - 1, whole) * unit)[None, :])
        value = np.where((starts >= s) & (starts < ends[None, :]), value, _INF)
        k = np.argmin(value, axis=0)  # the first (lowest) start on ties
        nxt = np.full(n + 1, _INF)
        nxt[ends] = value[k, np.arange(ends.size)]
        choice[s, ends] = k
        best = nxt
    if best[n] == _INF:
        return None
    cuts = [n]
    for s in range(count - 1, 0, -1):
        cuts.append(int(choice[s, cuts[-1]]))
    cuts.append(0)
    return cuts[::-1]


def balanced_variant(request: PlanRequest, item: Scored) -> Scored | None:
    """The same stages on the same devices with evenly balanced layer cuts
    (``_balanced_cuts``), or None if that is the same plan or does not fit in memory.

    Formula 2 tolerates a stage before the pivot that is heavier than the pivot as long as
    enough work lies between them (Algorithm 1), and its best plans can be slightly uneven
    (4.4); the simulator, which re-ranks the candidates, sometimes prefers the evenly
    balanced cut. Offering both lets the simulation decide.
    """
    cluster, global_batch_size = request.cluster, request.global_batch_size
    stages = item.stages
    if len(stages) < 2:
        return None
    tables = request.tables
    cuts = _balanced_cuts(tables, cluster, [stage.devices for stage in stages], global_batch_size // item.micro_batches)
    if cuts is None:
        return None
    new = tuple(StagePlan(layers=(cuts[s], cuts[s + 1]), devices=stage.devices, zero=stage.zero) for s, stage in enumerate(stages))
    if new == stages:
        return None
    scored = request.score(new, item.micro_batches)
    return scored if scored.fits(cluster) else None


def data_parallel_candidates(request: PlanRequest) -> list[Scored]:
    """DP (one stage on all devices) at every valid M and ZeRO level of the request,
    fitting or not, best first."""
    profile, cluster, global_batch_size, floor = request.profile, request.cluster, request.global_batch_size, request.floor
    g = cluster.num_devices
    levels = request.zero_levels if g > 1 else (0,)
    out = [
        request.score((StagePlan(layers=(0, profile.num_layers), devices=tuple(range(g)), zero=zero),), m)
        for zero in levels
        for m in request.micro_batches
        if g <= min((global_batch_size // m) // floor, global_batch_size // m)
    ]
    return sorted(out, key=lambda item: (not item.fits(cluster), item.latency_ms, item.micro_batches))


def straight_candidates(request: PlanRequest, keep: int = 1) -> list[Scored]:
    """The straight pipeline (G stages, one device each, ranks in order) that fits in memory.

    For every candidate M the layers are cut to minimise the slowest stage
    (``_balanced_cuts``); the plans are ranked by formula 2. Needs at least G layers. (The
    DP restricted to one replica per stage, ``dapple_search(straight_only=True)``, finds the
    formula's best straight cut instead; it is slower and the simulator often prefers the
    balanced one.)
    """
    profile, cluster, global_batch_size, floor = request.profile, request.cluster, request.global_batch_size, request.floor
    g = cluster.num_devices
    if profile.num_layers < g:
        return []
    tables = request.tables
    devices = [(rank,) for rank in range(g)]
    out = []
    for m in request.micro_batches:
        mbs = global_batch_size // m
        if mbs // floor < 1:
            continue
        cuts = _balanced_cuts(tables, cluster, devices, mbs)
        if cuts is None:
            continue
        stages = tuple(StagePlan(layers=(cuts[s], cuts[s + 1]), devices=devices[s]) for s in range(g))
        item = request.score(stages, m)
        if item.fits(cluster):
            out.append(item)
    out.sort(key=lambda item: (item.latency_ms, item.micro_batches))
    return out[:keep]


def shape_candidates(request: PlanRequest, devices: Sequence[tuple[int, ...]]) -> list[Scored]:
    """Plans of one given shape, stage ``s`` on ``devices[s]``: for every M whose
    micro-batch can be sliced over each stage's replicas, the layer cut that minimises the
    slowest stage (``_balanced_cuts``), priced by formula 2; those that fit, best first.
    ``straight_candidates`` is this for the straight shape."""
    cluster, global_batch_size = request.cluster, request.global_batch_size
    widest = max(len(stage) for stage in devices)
    out = []
    for m in request.micro_batches:
        mbs = global_batch_size // m
        if mbs < widest:
            continue
        cuts = _balanced_cuts(request.tables, cluster, devices, mbs)
        if cuts is None:
            continue
        stages = tuple(StagePlan(layers=(cuts[s], cuts[s + 1]), devices=tuple(devices[s])) for s in range(len(devices)))
        item = request.score(stages, m)
        if item.fits(cluster):
            out.append(item)
    out.sort(key=lambda item: (item.latency_ms, item.micro_batches))
    return out


def smallest_memory(request: PlanRequest) -> tuple[float, str]:
    """Peak per-device memory of the least memory-hungry plan we can name cheaply.

    Over every M and every number of stages S <= min(N, G): the straight partition whose
    largest per-device memory (weights, gradients, optimizer state and K_i stashed slices)
    is smallest, found by a bottleneck DP built from the last stage backwards (K_i depends on
    how many stages follow). Spare devices would only add replicas, which never add memory.
    """
    cluster, global_batch_size, floor = request.cluster, request.global_batch_size, request.floor
    tables = request.tables
    n, g = tables.n, cluster.num_devices
    best = (_INF, "")
    for m in request.micro_batches:
        search = StageSearch(tables, cluster, global_batch_size, m, floor, SearchSettings(request.policy, request.schedule, 1))
        s1 = search.scale(1)
        # cost[t][a]: min over partitions of layers [a, n) into t stages of the peak memory
        prev = [_INF] * (n + 1)
        prev[n] = 0.0
        for stages in range(1, min(n, g) + 1):
            kk = search.k_of(stages)
            cur = [_INF] * (n + 1)
            for a in range(n):
                for b in range(a + 1, n + 1):
                    if prev[b] == _INF or (b == n) != (stages == 1):
                        continue
                    mem = tables.params[a, b] * search.weight_factor + kk * tables.stash_bytes(a, b, s1)
                    cur[a] = min(cur[a], max(mem, prev[b]))
            prev = cur
            if cur[0] < best[0]:
                best = (cur[0], f"{stages} stage{'s' if stages > 1 else ''}, M={m}")
    return best
