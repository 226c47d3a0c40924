"""Cut a model into the chunks (virtual stages) of an interleaved or V-shaped plan.

Megatron's interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters", sec. 2.2.2) gives each of P device groups v chunks of consecutive
layers: stage k runs on group k mod P. ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism")
gives each group 2 chunks in a V: stage k on group k for k < P and on group 2P-1-k after.
Every group is equally busy only when each group's *total* work is the same; within that,
the bubble a chunk leaves grows with the chunk's own work, so chunks should be as even as
possible. (The DAPPLE planner's own cuts are contiguous per device group, sec. 4; these are
not, so they need their own cut.)

``cut_chunks`` chooses the P*v - 1 cut points in that order of goals: first the largest
group load (work per device: a group's layers' F+B times the share of a micro-batch each of
its replicas runs, as ``plan.costs.stage_costs`` charges the layers; the user's step around
them, a fixed time on the first and last chunks, is priced in the plan but not balanced
here), then the spread of the chunk
loads (sum of squares). It starts from the cuts at each stage's share of the cumulative
work, moves single cut points by one layer while that improves the score, and from that
bound runs a branch and bound over all cuts (``_CutSearch``): exact unless the instance is
too large for its node budget, where it keeps the best cut found. ``chunked_stages`` turns a
plan's device groups into such stages.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.costs import slice_size
from lightning_dapple.plan.plan import StagePlan, chunk_placement
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["chunk_placement", "chunked_stages", "cut_chunks", "group_loads"]

#: prefixes the exact search visits before it settles for the best cut found (about 0.1 s)
SEARCH_NODES = 10_000

Score = tuple[float, float]


def group_loads(weights: Sequence[float], ends: Sequence[int], placement: Sequence[int], group_scale: Sequence[float]) -> list[float]:
    """Each group's work: its stages' layer weights summed, times the group's per-device scale."""
    loads = [0.0] * len(group_scale)
    start = 0
    for end, group in zip(ends, placement):
        loads[group] += math.fsum(weights[start:end]) * group_scale[group]
        start = end
    return loads


def _score(prefix: Sequence[float], ends: Sequence[int], placement: Sequence[int], group_scale: Sequence[float]) -> Score:
    """(largest group load, sum of squared chunk loads): lower is better, in that order."""
    loads = [0.0] * len(group_scale)
    squares, start = 0.0, 0
    for end, group in zip(ends, placement):
        chunk = (prefix[end] - prefix[start]) * group_scale[group]
        loads[group] += chunk
        squares += chunk * chunk
        start = end
    return max(loads), squares


def _initial_ends(prefix: Sequence[float], placement: Sequence[int], group_scale: Sequence[float]) -> list[int]:
    """Cut points at each stage's share of the cumulative work (a group's share is inverse to
    its per-device scale), moved apart so every stage keeps at least one layer."""
    n, stages = len(prefix) - 1, len(placement)
    shares = [1.0 / group_scale[group] for group in placement]
    total_share, total = math.fsum(shares), prefix[-1]
    ends, acc = [], 0.0
    for index in range(stages - 1):
        acc += shares[index]
        target = total * acc / total_share
        cut = bisect_left(prefix, target)
        if cut > 0 and target - prefix[cut - 1] < prefix[min(cut, n)] - target:
            cut -= 1
        low = (ends[-1] if ends else 0) + 1
        ends.append(min(max(cut, low), n - (stages - 1 - index)))
    return [*ends, n]


def _polish(prefix: Sequence[float], ends: list[int], placement: Sequence[int], group_scale: Sequence[float]) -> list[int]:
    """Move single cut points by one layer while the score improves (each move strictly lowers
    it, so this ends)."""
    best = _score(prefix, ends, placement, group_scale)
    improved = True
    while improved:
        improved = False
        for index in range(len(ends) - 1):
            low = (ends[index - 1] if index else 0) + 1
            for step in (-1, 1):
                cut = ends[index] + step
                if not low <= cut < ends[index + 1]:
                    continue
                trial = [*ends[:index], cut, *ends[index + 1 :]]
                score = _score(prefix, trial, placement, group_scale)
                if score < best:
                    ends, best, improved = trial, score, True
    return ends


class _CutSearch:
    """Depth-first branch and bound over the cut points, stage by stage: a stage's end stops
    growing once its group exceeds the best largest load found, and a prefix is dropped when
    the groups still to come cannot take the remaining work under that load. Exact unless
    ``SEARCH_NODES`` prefixes are visited first (then the best found, never worse than the
    start)."""

    def __init__(self, prefix: Sequence[float], placement: Sequence[int], group_scale: Sequence[float], start: list[int]) -> None:
        self.prefix, self.placement, self.scale = prefix, placement, group_scale
        self.best_score, self.best = _score(prefix, start, placement, group_scale), list(start)
        self.later = [set(placement[k:]) for k in range(len(placement) + 1)]
        self.loads = [0.0] * len(group_scale)
        self.ends: list[int] = []
        self.nodes = 0

    def run(self) -> list[int]:
        self._extend(0, 0, 0.0)
        return self.best

    def _extend(self, stage: int, start: int, squares: float) -> None:
        self.nodes += 1
        prefix, n, last = self.prefix, len(self.prefix) - 1, len(self.placement) - 1
        group = self.placement[stage]
        if stage == last:
            chunk = (prefix[n] - prefix[start]) * self.scale[group]
            loads = [*self.loads[:group], self.loads[group] + chunk, *self.loads[group + 1 :]]
            score = (max(loads), squares + chunk * chunk)
            if score < self.best_score:
                self.best_score, self.best = score, [*self.ends, n]
            return
        bound = self.best_score[0] * (1 + 1e-12)
        for end in range(start + 1, n - (last - stage) + 1):
            if self.nodes > SEARCH_NODES:
                return
            chunk = (prefix[end] - prefix[start]) * self.scale[group]
            if self.loads[group] + chunk > bound:
                break
            self.loads[group] += chunk
            room = math.fsum(max(0.0, bound - self.loads[g]) / self.scale[g] for g in self.later[stage + 1])
            if room >= prefix[n] - prefix[end]:
                self.ends.append(end)
                self._extend(stage + 1, end, squares + chunk * chunk)
                self.ends.pop()
            self.loads[group] -= chunk


def cut_chunks(weights: Sequence[float], placement: Sequence[int], group_scale: Sequence[float] | None = None) -> tuple[int, ...]:
    """The end layer of each stage (the last is ``len(weights)``) when ``weights`` (per-layer
    work) is cut into ``len(placement)`` consecutive non-empty stages, stage k on device group
    ``placement[k]`` whose work is multiplied by ``group_scale[g]`` (default 1 for all: the
    share of a micro-batch one device of the group runs). See the module docstring."""
    stages, n = len(placement), len(weights)
    groups = max(placement) + 1 if placement else 0
    scale = [float(value) for value in group_scale] if group_scale is not None else [1.0] * groups
    require(stages >= 1, "chunks", "are none", "give at least one stage")
    require(len(scale) == groups, "group_scale", f"has {len(scale)} entries for {groups} device groups", "give one scale per group")
    require(all(value > 0 for value in scale), "group_scale", f"is {scale}", "give positive scales")
    require(
        n >= stages,
        "chunks",
        f"{stages} stages ({groups} device groups x {stages // max(groups, 1)} chunks) need at least {stages} layers, the model has {n}",
        "use fewer chunks per device group (or fewer groups)",
    )
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + float(weight))
    start = _polish(prefix, _initial_ends(prefix, placement, scale), placement, scale)
    return tuple(_CutSearch(prefix, placement, scale, start).run())


def chunked_stages(
    profile: ModelProfile, groups: Sequence[tuple[int, ...]], schedule: str, chunks: int, micro_batch_size: int
) -> tuple[StagePlan, ...]:
    """Stages of a ``schedule`` plan ('interleaved' or 'zbv') with ``chunks`` stages on each
    of ``groups`` (device lists), the layers cut by ``cut_chunks`` with the per-layer F+B the
    cost model sums and each group's slice of a ``micro_batch_size`` micro-batch."""
    placement = chunk_placement(schedule, len(groups), chunks)
    weights = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    scale = [profile.scale(slice_size(micro_batch_size, len(devices))) for devices in groups]
    ends = cut_chunks(weights, placement, scale)
    starts = (0, *ends[:-1])
    return tuple(StagePlan(layers=(a, b), devices=tuple(groups[g])) for a, b, g in zip(starts, ends, placement))
