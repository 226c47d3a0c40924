"""Local improvement of a search result (``polish``): small edits priced from range tables.

A beam-limited search (large instances, ``dapple_planner.search_effort``) may drop the
prefix of a better plan; hill-climbing from its best results with edits of one stage
boundary or one replica recovers most of that, pricing each edit with formula 2
(DAPPLE 4.1.2) from the range tables instead of a full ``stage_costs``.
"""
from __future__ import annotations

from typing import Callable, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import dapple_latency, slice_size
from lightning_dapple.plan.evaluate import Scored, memory_per_stage, score_stages
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.search_tables import RangeTables, p2p_ms_fast
from lightning_dapple.profile.action_overhead import ActionOverhead
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["polish", "consecutive"]


def consecutive(shape: Sequence[tuple[int, int, int]], zero: int = 0) -> tuple[StagePlan, ...]:
    """Stages of ``shape`` ((start, end, replicas) each) on consecutive ranks, the replicated
    ones at ZeRO level ``zero``."""
    stages = []
    rank = 0
    for a, b, r in shape:
        stages.append(StagePlan(layers=(a, b), devices=tuple(range(rank, rank + r)), zero=zero if r > 1 else 0))
        rank += r
    return tuple(stages)


class _QuickCost:
    """The StageCost fields formula 2 and the memory model read, from the range tables
    (the same sums as ``stage_costs``, the user's step on the first and last stages too); used to score many small edits quickly. Any other
    field (recomputation time, ...) reads as 0, which is what a plan without
    recomputation has."""

    __slots__ = ("forward_ms", "backward_ms", "tail_ms", "send_ms", "param_bytes", "stash_bytes", "overhead", "replicas", "zero", "accumulate_ms")

    def __getattr__(self, name: str) -> float:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0.0

    def __init__(
        self, forward_ms: float, backward_ms: float, tail_ms: float, send_ms: float, param_bytes: float, stash_bytes: float,
        overhead: ActionOverhead, replicas: int = 1, zero: int = 0, accumulate_ms: float = 0.0,
    ) -> None:
        self.accumulate_ms = accumulate_ms
        self.overhead = overhead
        self.replicas = replicas
        self.zero = zero
        self.forward_ms = forward_ms
        self.backward_ms = backward_ms
        self.tail_ms = tail_ms
        self.send_ms = send_ms
        self.param_bytes = param_bytes
        self.stash_bytes = stash_bytes


def _tail_ms(tables: RangeTables, cluster: Cluster, stage: StagePlan, per_device: float) -> float:
    """The stage's ``tail_ms`` (exposed AllReduce and optimizer step, at its ZeRO level) from
    the range tables."""
    a = 0.0
    if stage.replicas > 1:
        coef = 2.0 * (stage.replicas - 1) / stage.replicas
        a = coef / cluster.bytes_per_ms(cluster.ring_bandwidth_gbps(stage.devices))
    return tables.stage_tail(a, cluster.ring_latency_ms(stage.replicas), per_device, stage.start, stage.end, stage.replicas, stage.zero)


def _quick_latency(tables: RangeTables, cluster: Cluster, stages: Sequence[StagePlan], mbs: int, m: int, policy: str, schedule: str) -> tuple[float, bool]:
    """(formula-2 latency, fits in memory) of ``stages`` priced from the tables."""
    whole = mbs / tables.pbs
    costs = []
    for index, stage in enumerate(stages):
        a, b = stage.layers
        per_device = slice_size(mbs, stage.replicas) / tables.pbs
        send = 0.0
        if index + 1 < len(stages):
            send = p2p_ms_fast(cluster, tables.cut_bytes(b - 1, whole), stage.devices, stages[index + 1].devices)
        params = float(tables.params[a, b])
        first, last = a == 0, b == tables.n
        costs.append(
            _QuickCost(
                float(tables.forward[a, b]) * per_device + tables.glue.forward_ms(first, last),
                float(tables.backward[a, b]) * per_device + tables.glue.backward_ms(last),
                _tail_ms(tables, cluster, stage, per_device),
                send,
                params,
                float(tables.stash_bytes(a, b, per_device)),
                tables.overhead,
                stage.replicas,
                stage.zero if stage.replicas > 1 else 0,
                float(tables.accumulate[a, b]),
            )
        )
    memory = memory_per_stage(costs, m, cluster, policy, schedule)  # type: ignore[arg-type]
    return dapple_latency(costs, m).latency_ms, max(memory) <= cluster.device_memory_bytes  # type: ignore[arg-type]


def polish(
    profile: ModelProfile,
    cluster: Cluster,
    start: Scored,
    global_batch_size: int,
    policy: str,
    schedule: str,
    min_slice: int,
    rounds: int = 12,
    tables: "RangeTables | None" = None,
    rescore: "Callable[[tuple[StagePlan, ...], int], Scored] | None" = None,
) -> Scored:
    """Hill-climb from a DP result with small edits, keeping what formula 2 likes better.

    Used after a beam-limited search (large instances), where the beam may have dropped the
    prefix of a better plan: shift a stage boundary by 1, 2, 4 or 8 layers, move one replica
    between two stages, merge two neighbours, or split a replicated stage in two. Edits that
    change replica counts place stages on consecutive ranks; every candidate is priced with
    ``score_stages`` and must fit in memory with slices of at least ``min_slice`` samples.
    Replicated stages keep the ZeRO level of ``start``'s (the search's level). ``rescore``
    prices the result (``PlanRequest.score``; default ``score_stages``).
    """
    tables = tables or RangeTables(profile)
    zero = max((stage.zero for stage in start.stages), default=0)
    m = start.micro_batches
    mbs = global_batch_size // m
    rmax = min(mbs // min_slice, mbs)
    best_stages, best_latency = start.stages, start.latency_ms
    seen: set[tuple] = {tuple((s.start, s.end, s.devices) for s in start.stages)}
    for _ in range(rounds):
        shape = [(s.start, s.end, s.replicas) for s in best_stages]
        options: list[tuple[StagePlan, ...]] = []
        for i in range(len(shape) - 1):
            for delta in (-8, -4, -2, -1, 1, 2, 4, 8):
                cut = best_stages[i].end + delta
                if best_stages[i].start < cut < best_stages[i + 1].end:
                    edited = list(best_stages)
                    edited[i] = StagePlan((edited[i].start, cut), edited[i].devices, zero=edited[i].zero)
                    edited[i + 1] = StagePlan((cut, edited[i + 1].end), edited[i + 1].devices, zero=edited[i + 1].zero)
                    options.append(tuple(edited))
        for i in range(len(shape)):
            for k in range(len(shape)):
                if i != k and shape[i][2] >= 2 and shape[k][2] + 1 <= rmax:
                    edited_shape = list(shape)
                    edited_shape[i] = (shape[i][0], shape[i][1], shape[i][2] - 1)
                    edited_shape[k] = (shape[k][0], shape[k][1], shape[k][2] + 1)
                    options.append(consecutive(edited_shape, zero))
            if i + 1 < len(shape) and shape[i][2] + shape[i + 1][2] <= rmax:
                options.append(consecutive(shape[:i] + [(shape[i][0], shape[i + 1][1], shape[i][2] + shape[i + 1][2])] + shape[i + 2 :], zero))
            a, b, r = shape[i]
            if r >= 2 and b - a >= 2:
                mid = (a + b) // 2
                options.append(consecutive(shape[:i] + [(a, mid, r // 2), (mid, b, r - r // 2)] + shape[i + 1 :], zero))
        improved = None
        for stages in options:
            key = tuple((s.start, s.end, s.devices) for s in stages)
            if key in seen or any(s.replicas > rmax for s in stages):
                continue
            seen.add(key)
            latency, fits = _quick_latency(tables, cluster, stages, mbs, m, policy, schedule)
            if fits and latency < best_latency - 1e-9:
                improved, best_latency = stages, latency
        if improved is None:
            break
        best_stages = improved
    if best_stages == start.stages:
        return start
    if rescore is not None:
        return rescore(best_stages, m)
    return score_stages(profile, cluster, best_stages, global_batch_size, m, policy, schedule)
