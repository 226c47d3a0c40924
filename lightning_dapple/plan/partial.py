"""Partial plans of DAPPLE's search (4.3) and the sets the search keeps of them.

A partial plan has planned the first layers as complete stages on concrete ranks; the
rest of the model is still to be split. Besides its stages it carries the quantities
through which its prefix influences any completion of formula 2 (DAPPLE 4.1.2), so that
sub-problems can keep a small Pareto set of candidates instead of one.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_dapple.plan.costs import pivot_parts, walk_pivot

__all__ = ["RawStages", "PartialPlan", "TopPlans", "dominates", "rank", "beam_select"]

_INF = float("inf")
_NEG = float("-inf")
RawStages = tuple[tuple[int, int, tuple[int, ...]], ...]


@dataclass(eq=False, slots=True)
class PartialPlan:
    """A planned prefix: complete stages on concrete ranks plus the features the DP needs."""

    stages: RawStages
    phases: tuple[tuple[float, float, float], ...]
    occupied: frozenset[int]
    end: int
    pf: float  # sum of forward times (warm-up contribution)
    tail: float  # max_s AR_s + B_{s..e}: the prefix's share of the ending phase
    claim: float  # max_s h_s: how strongly the prefix pulls the pivot into itself
    max_fb: float
    sum_fb: float
    smax: float  # most stages the plan may have before a prefix stage runs out of memory
    lb: float
    tpl: float  # latency of this prefix with the rest as one stage (paper's T_PL), inf if none
    _records: Any = None
    _arrays: Any = None

    @property
    def last(self) -> tuple[int, ...] | None:
        return self.stages[-1][2] if self.stages else None

    def records(self, m1: int) -> tuple[list[float], list[tuple[float, float, float]]]:
        """Pivot records of the prefix (see module docstring) and, per record, the pivot's
        (warm-up + steady, ending within the prefix, backward sum after the pivot)."""
        if self._records is not None:
            return self._records
        phases = self.phases
        e = len(phases) - 1
        fb = [f + b for f, b, _ in phases]
        hs: list[float] = []
        data: list[tuple[float, float, float]] = []
        best = _NEG
        after = 0.0
        for s in range(e, -1, -1):
            h = m1 * fb[s] - after
            if h > best:
                best = h
                q = walk_pivot(phases, s, m1)
                hs.append(h)
                data.append(pivot_parts(phases, q, m1))
            after += fb[s]
        self._records = (hs, data)
        return self._records

    def record_arrays(self, m1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``records`` as arrays (h ascending; warm-up + steady, ending, backward after the
        pivot), built once per candidate for the search's vectorised lookups."""
        if self._arrays is None:
            hs, data = self.records(m1)
            self._arrays = (np.array(hs), np.array([d[0] for d in data]), np.array([d[1] for d in data]), np.array([d[2] for d in data]))
        return self._arrays


def dominates(a: PartialPlan, b: PartialPlan) -> bool:
    """``a`` is at least as good as ``b`` for every completion we can reason about.

    Only ``tpl`` and ``max_fb`` of the ranking are compared, so the pre-filter in
    ``_insert_pending`` compares ranks before building a candidate only when that is safe.
    """
    return (
        a.tpl <= b.tpl
        and a.max_fb <= b.max_fb
        and a.pf <= b.pf
        and a.tail <= b.tail
        and a.claim <= b.claim
        and a.smax >= b.smax
    )


def rank(c: PartialPlan) -> tuple[float, ...]:
    """Which of a sub-problem's non-dominated candidates to keep when there are too many:
    the paper's own criterion first (T_PL, the latency with the rest as one stage), then
    the bound, then balance."""
    return (c.tpl, c.lb, c.max_fb, c.claim, c.pf + max(c.tail, 0.0), -c.smax)


def beam_select(layer: list[PartialPlan], beam: int) -> list[PartialPlan]:
    """The sub-problems of one layer j worth expanding: alternately the next lowest bound
    (optimistic) and the next lowest T_PL (the latency actually reached with the rest as
    one stage)."""
    by_bound = sorted(layer, key=lambda c: (c.lb, c.tpl))
    by_tpl = sorted(layer, key=lambda c: (c.tpl, c.lb))
    chosen: list[PartialPlan] = []
    seen: set[int] = set()
    for a, b in zip(by_bound, by_tpl):
        for c in (a, b):
            if id(c) not in seen and len(chosen) < beam:
                seen.add(id(c))
                chosen.append(c)
        if len(chosen) >= beam:
            break
    return chosen


class TopPlans:
    """The ``keep`` best complete plans seen, without duplicates, and the bar a new plan
    (or a sub-problem's bound) must stay under: ``threshold``, the ``keep``-th best
    latency once there are that many, and at most ``cap`` (``set_cap``). ``items`` change
    only through ``add``, which keeps the threshold up to date."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.cap = _INF
        self.items: list[tuple[float, int, int, RawStages]] = []
        self.seen: set[tuple[int, RawStages]] = set()
        self._threshold = _INF

    @property
    def threshold(self) -> float:
        return self._threshold

    def set_cap(self, cap: float) -> None:
        """No plan at or above ``cap`` is wanted any more (the plans kept so far stay)."""
        self.cap = cap
        self._update()

    def _update(self) -> None:
        kept = self.items[-1][0] if len(self.items) >= self.keep else _INF
        self._threshold = min(kept, self.cap)

    def add(self, latency: float, micro_batches: int, stages: RawStages) -> None:
        if latency >= self.threshold:
            return
        key = (micro_batches, stages)
        if key in self.seen:
            return
        self.seen.add(key)
        bisect.insort(self.items, (latency, len(stages), micro_batches, stages))
        while len(self.items) > self.keep:
            dropped = self.items.pop()
            self.seen.discard((dropped[2], dropped[3]))
        self._update()
