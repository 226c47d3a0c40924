"""DAPPLE's planner (section 4): partition, replication and placement that minimise formula 2.

The search is the dynamic programme of DAPPLE 4.3 (formulas 4-5). A sub-problem
``T_PL(j, m, g)`` has planned the first ``j`` layers as complete stages on the device set
``g`` (``m = |g|``); the unplanned layers form one last stage replicated on the other
``G - m`` devices, so every sub-problem is itself a complete plan with a latency (formula
2). A step splits that last stage at ``j'`` and gives the new stage ``m'`` devices chosen by
one of the placement policies of 4.2 (``placement.py``: Fresh First, Append First, Scatter
First, plus three variants of ours on clusters of up to 16 devices); the layers after ``j'``
stay one stage on the rest. DP (one stage on all G devices) and the straight pipeline (one device per
stage) are both points of this space.

How this differs from a literal reading, and why:

* **Pivot, incrementally (4.3).** Algorithm 1 walks from the last stage towards the first.
  For a prefix we precompute where that walk would go once it enters the prefix: with
  ``h_s = (M-1)(F_s+B_s) - sum_{s<t<=e}(F_t+B_t)`` the walk moves into the prefix at the
  largest ``s`` with ``h_s > X`` (``X`` being the current pivot's steady time plus the work
  after the prefix up to and including the pivot, as ``costs.pivot_stage`` charges it), and
  from there on it only sees prefix stages, so its end point is precomputed too.
  Appending a stage therefore costs O(log S), not a re-walk, and the latency computed is
  formula 2 itself (up to float rounding of the transfer times; every returned plan is
  re-priced with ``costs.dapple_latency``).
* **Several candidates per sub-problem.** Formula 2 has no optimal substructure: the prefix
  that is best with one remainder is not always best once the remainder is split further
  (the pivot may move). The paper keeps one plan per sub-problem; we keep a small Pareto set
  (``keep_per_state`` candidates) over the quantities through which a prefix influences any
  completion: its forward sum (warm-up), its backward-plus-AllReduce tail (ending phase),
  its strongest pivot claim ``max h_s``, its largest F+B, how many further stages its
  memory allows, and the paper's own T_PL; the kept ones are the best by ``_rank``.
  tests/test_planner_optimality.py shows a case where one candidate is not enough.
* **Symmetry of the placement state (4.2).** Costs depend on which devices share a machine,
  not on machine or device numbers: permuting machines, or devices within a machine,
  consistently across a whole plan leaves every ``allreduce_ms`` (one ring bandwidth
  decision) and, with each stage's ranks kept in machine order, every split-concat
  ``p2p_ms`` unchanged up to the order in which machines are visited. The placement
  policies only look at per-machine free counts, and the cost of the next transfer only at
  how the last stage sits on the machines. So a sub-problem is keyed by
  ``(j, sorted((free_k, last_k) for every machine k))`` -- free devices and devices of the
  last planned stage per machine, machines unordered -- and one concrete placement per
  candidate is kept and priced exactly. (Where two keyed-equal states differ in machine
  order the split-concat pairing can differ; every plan returned is priced on its concrete
  ranks with ``stage_costs``, so this only affects which candidates are explored.)
* **Branch and bound** (``lower_bound``). For any plan, formula 2 with ``costs.pivot_stage``
  satisfies ``L >= (M-1) max_s (F_s+B_s)`` over all stages, communication stages included,
  and ``L >= sum_{s in prefix} (F_s+B_s) + M * (work after the prefix) / (devices left)``
  for every prefix of stages. (Proof sketch: the warm-up, steady phase and the ending term of
  stage 0 give ``L >= FB_{0..Q} + (M-1) FB_Q``; every move of Algorithm 1 to a stage s
  needs ``(M-1) FB_s > (M-1) FB_Q + FB_{s+1..Q}``, and every stage it passes over satisfies
  the reverse, which telescopes into ``FB_{a..Q} + (M-1) FB_Q >= M FB_s`` for each stage s
  from a on, whether the pivot ends up inside the prefix or after it; a suffix on f devices
  has a stage with ``F+B >= its work / f``.) A prefix whose bound reaches the ``rerank``-th
  best complete plan found so far is dropped, and the new stage's end ``j'`` is bracketed
  with the bound's monotone parts.
* **Effort by size** (``search_effort``). Small instances get the full Pareto sets; large
  ones a beam per layer plus a local polish (``polish``) of the best results.
* **Micro-batches.** M is searched over the divisors of the global batch whose micro-batch
  is at least ``min_slice`` samples (see ``evaluate.py`` for why there is a floor); a stage
  may have at most ``micro_batch_size // min_slice`` replicas.
* **Re-ranking.** The best ``rerank`` plans under the formula, the same plans with evenly
  balanced layer cuts (``balanced_variant``), and DP and the straight pipeline when valid
  and within memory, are simulated (``simulate_plan``); the fastest simulated plan is
  returned. The formula ignores bubbles inside the pivot stage (4.1) and lets a stage
  before the pivot be heavier than the pivot; the simulator does not.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import dapple_latency, slice_size
from lightning_dapple.plan.evaluate import (
    Scored,
    candidate_micro_batches,
    check_inputs,
    default_min_slice,
    finish_plan,
    format_bytes,
    format_gib,
    memory_per_stage,
    raise_no_memory,
    score_stages,
    simulate_or_none,
    subcluster,
)
from lightning_dapple.plan.overlap import OverlapTables
from lightning_dapple.plan.placement import PlacementState, placement_options
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = [
    "plan_dapple",
    "dapple_search",
    "search_effort",
    "lower_bound",
    "polish",
    "balanced_variant",
    "data_parallel_candidates",
    "straight_candidates",
    "describe_choice",
    "p2p_ms_fast",
]

_INF = float("inf")
_NEG = float("-inf")
RawStages = tuple[tuple[int, int, tuple[int, ...]], ...]


# --------------------------------------------------------------------------- tables


class _Tables:
    """Per-profile range sums, accumulated exactly as ``stage_costs`` sums them (so ties in
    Algorithm 1 resolve the same way in the search and in the official formula)."""

    def __init__(self, profile: ModelProfile) -> None:
        layers = profile.layers
        n = len(layers)
        self.n = n
        self.pbs = profile.micro_batch_size
        self.forward = self._range_sums([layer.forward_ms for layer in layers])
        self.backward = self._range_sums([layer.backward_ms for layer in layers])
        self.params = self._range_sums([layer.param_bytes for layer in layers])
        self.stash = self._range_sums([layer.stash_bytes for layer in layers])
        self.work = self.forward + self.backward
        self.output = np.array([layer.output_bytes for layer in layers], dtype=float)
        self.overlap = OverlapTables([layer.param_bytes for layer in layers], [layer.backward_ms for layer in layers])

    @staticmethod
    def _range_sums(values: Sequence[float]) -> np.ndarray:
        n = len(values)
        table = np.zeros((n + 1, n + 1))
        for a in range(n):
            acc = 0
            row = table[a]
            for b in range(a, n):
                acc = acc + values[b]
                row[b + 1] = acc
        return table


# --------------------------------------------------------------------------- candidates


@dataclass(eq=False)
class _Cand:
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
                q = _walk_from(phases, s, m1)
                hs.append(h)
                data.append(_pivot_parts(phases, q, m1))
            after += fb[s]
        self._records = (hs, data)
        return self._records


def _walk_from(phases: Sequence[tuple[float, float, float]], pivot: int, m1: int) -> int:
    """Algorithm 1 continued from ``pivot`` towards stage 0 (as ``costs.pivot_stage``:
    the work charged against a move runs from s + 1 up to and including the pivot)."""
    for s in range(pivot - 1, -1, -1):
        own = m1 * (phases[s][0] + phases[s][1])
        current = m1 * (phases[pivot][0] + phases[pivot][1])
        current += sum(phases[k][0] + phases[k][1] for k in range(s + 1, pivot + 1))
        if own > current:
            pivot = s
    return pivot


def _pivot_parts(phases: Sequence[tuple[float, float, float]], q: int, m1: int) -> tuple[float, float, float]:
    warm = sum(phases[s][0] for s in range(q + 1))
    steady = m1 * (phases[q][0] + phases[q][1])
    ending = _NEG
    for s, (_, _, allreduce) in enumerate(phases):
        if s <= q:
            tail = sum(phases[a][1] for a in range(s, q + 1))
        else:
            tail = -sum(phases[a][1] for a in range(q + 1, s + 1))
        ending = max(ending, allreduce + tail)
    after = sum(phases[a][1] for a in range(q + 1, len(phases)))
    return warm + steady, ending, after


def _dominates(a: _Cand, b: _Cand) -> bool:
    """``a`` is at least as good as ``b`` for every completion we can reason about.

    Only ``tpl`` and ``max_fb`` of the ranking are compared, so the pre-filter in
    ``expand`` compares ranks before building a candidate only when that is safe.
    """
    return (
        a.tpl <= b.tpl
        and a.max_fb <= b.max_fb
        and a.pf <= b.pf
        and a.tail <= b.tail
        and a.claim <= b.claim
        and a.smax >= b.smax
    )


def _rank(c: _Cand) -> tuple[float, ...]:
    """Which of a sub-problem's non-dominated candidates to keep when there are too many:
    the paper's own criterion first (T_PL, the latency with the rest as one stage), then
    the bound, then balance."""
    return (c.tpl, c.lb, c.max_fb, c.claim, c.pf + max(c.tail, 0.0), -c.smax)


def _beam_select(layer: list[_Cand], beam: int) -> list[_Cand]:
    """The sub-problems of one layer j worth expanding: alternately the next lowest bound
    (optimistic) and the next lowest T_PL (the latency actually reached with the rest as
    one stage)."""
    by_bound = sorted(layer, key=lambda c: (c.lb, c.tpl))
    by_tpl = sorted(layer, key=lambda c: (c.tpl, c.lb))
    chosen: list[_Cand] = []
    seen: set[int] = set()
    for a, b in zip(by_bound, by_tpl):
        for c in (a, b):
            if id(c) not in seen and len(chosen) < beam:
                seen.add(id(c))
                chosen.append(c)
        if len(chosen) >= beam:
            break
    return chosen


class _Top:
    """The ``keep`` best complete plans seen, without duplicates."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self.items: list[tuple[float, int, int, RawStages]] = []
        self.seen: set[tuple[int, RawStages]] = set()

    @property
    def threshold(self) -> float:
        return self.items[-1][0] if len(self.items) >= self.keep else _INF

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


# --------------------------------------------------------------------------- search


@dataclass
class _Settings:
    policy: str
    schedule: str
    keep_per_state: int
    straight_only: bool = False
    extended: bool = True
    beam: int | None = None

    @property
    def beam_insert(self) -> int:
        """Sub-problems admitted per layer when a beam is set (more than are expanded)."""
        return 4 * (self.beam or 0)


@dataclass
class _Succ:
    """One placement of a next stage: its ranks, what is left, and the new state's key."""

    r: int
    ranks: tuple[int, ...]
    occupied: frozenset[int]
    rest: tuple[int, ...]
    key: Any = None  # filled when first needed


def p2p_ms_fast(cluster: Cluster, num_bytes: float, senders: Sequence[int], receivers: Sequence[int]) -> float:
    """``Cluster.p2p_ms`` in O(a + b) instead of O(a b): the split-concat pieces (DAPPLE
    5.2.2) are the overlaps of two partitions of [0, 1), found by one sweep in the same
    (sender, receiver) order, so the sums are accumulated exactly as ``p2p_ms`` does.
    ``tests/test_planner.py`` checks the two agree."""
    if num_bytes <= 0:
        return 0.0
    a, b = len(senders), len(receivers)
    per = cluster.devices_per_machine
    network_out: dict[int, float] = {}
    network_in: dict[int, float] = {}
    local_out: dict[int, float] = {}
    local_in: dict[int, float] = {}
    i = j = 0
    while i < a and j < b:
        lo = max(i / a, j / b)
        end_i, end_j = (i + 1) / a, (j + 1) / b
        hi = min(end_i, end_j)
        if hi > lo + 1e-12:
            src, dst = senders[i], receivers[j]
            if src != dst:
                size = (hi - lo) * num_bytes
                ms, md = src // per, dst // per
                if ms != md:
                    network_out[ms] = network_out.get(ms, 0.0) + size
                    network_in[md] = network_in.get(md, 0.0) + size
                else:
                    local_out[src] = local_out.get(src, 0.0) + size
                    local_in[dst] = local_in.get(dst, 0.0) + size
        if end_i < end_j:
            i += 1
        elif end_j < end_i:
            j += 1
        else:
            i += 1
            j += 1
    network = max([*network_out.values(), *network_in.values(), 0.0]) / cluster.bytes_per_ms(cluster.inter_bandwidth_gbps)
    local = max([*local_out.values(), *local_in.values(), 0.0]) / cluster.bytes_per_ms(cluster.intra_bandwidth_gbps)
    if network == 0.0 and local == 0.0:
        return 0.0
    return max(network, local) + cluster.latency_ms


class _Shared:
    """Memo tables that do not depend on M: placements offered per placement state."""

    def __init__(self) -> None:
        self.successors: dict[tuple, list[_Succ]] = {}
        self.p2p: dict[tuple, tuple[float, float]] = {}
        self.rings: dict[tuple[int, ...], tuple[float, float]] = {}


class _Search:
    """One DP run for a fixed number of micro-batches M."""

    def __init__(self, tables: _Tables, cluster: Cluster, global_batch_size: int, micro_batches: int, min_slice: int, settings: _Settings, shared: _Shared | None = None) -> None:
        self.shared = shared or _Shared()
        self.shallow = False
        self.t = tables
        self.cluster = cluster
        self.m = micro_batches
        self.m1 = micro_batches - 1
        self.mbs = global_batch_size // micro_batches
        self.whole = self.mbs / tables.pbs
        self.rmax = min(self.mbs // min_slice, self.mbs, cluster.num_devices)
        self.settings = settings
        self.cap = cluster.device_memory_bytes
        self.weight_factor = 2.0 + cluster.optimizer_state_factor
        self.lat = cluster.latency_ms
        self.per = cluster.devices_per_machine

    # -- cost helpers (the formulas of costs.py / cluster.py, vectorised) --------------

    def scale(self, replicas: int) -> float:
        return slice_size(self.mbs, replicas) / self.t.pbs

    def k_of(self, t: int) -> int:
        """K_i of a stage with ``t`` stages from it to the end (itself included)."""
        if self.settings.schedule == "gpipe":
            return self.m
        wanted = t if self.settings.policy == "PA" else 2 * t - 1
        return max(1, min(wanted, self.m))

    def t_max(self, weights: np.ndarray, stash: np.ndarray) -> np.ndarray:
        """Largest ``t`` (stages from here to the end) at which the stage still fits."""
        room = self.cap - weights
        with np.errstate(divide="ignore", invalid="ignore"):
            kmax = np.where(stash > 0, np.floor(room / np.where(stash > 0, stash, 1.0)), np.where(room >= 0, _INF, -1.0))
        kmax = np.where(room < 0, -1.0, kmax)
        # floor() of a quotient can be one off; settle it with the exact test the filter uses
        finite = np.isfinite(kmax) & (kmax >= 0)
        safe = np.where(finite, kmax, 0.0)
        up = finite & (weights + (safe + 1) * stash <= self.cap)
        kmax = np.where(up, kmax + 1, kmax)
        safe = np.where(finite, kmax, 0.0)
        down = finite & (weights + safe * stash > self.cap)
        kmax = np.where(down, kmax - 1, kmax)
        if self.settings.schedule == "gpipe":
            return np.where(kmax >= self.m, _INF, -1.0)
        if self.settings.policy == "PA":
            return np.where(kmax >= self.m, _INF, kmax)
        return np.where(kmax >= self.m, _INF, np.floor((kmax + 1) / 2))

    def p2p_unit(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> tuple[float, float]:
        """``p2p_ms`` is ``bytes * unit + latency`` for any positive byte count (memoised
        across M; equal to ``p2p_ms`` up to rounding, and plans are re-priced exactly)."""
        key = (senders, receivers)
        found = self.shared.p2p.get(key)
        if found is None:
            probe = 1e6
            found = self.shared.p2p[key] = ((p2p_ms_fast(self.cluster, probe, senders, receivers) - self.lat) / probe, self.lat)
        return found

    def ring(self, ranks: tuple[int, ...]) -> tuple[float, float]:
        """(2 (r-1) / r, bytes per ms of the ring) of an AllReduce among ``ranks``, memoised."""
        found = self.shared.rings.get(ranks)
        if found is None:
            r = len(ranks)
            coef = 2.0 * (r - 1) / r if r > 1 else 0.0
            found = self.shared.rings[ranks] = (coef, self.cluster.bytes_per_ms(self.cluster.ring_bandwidth_gbps(ranks)))
        return found

    def key(self, occupied: frozenset[int], last: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        free = [self.per] * self.cluster.machines
        for rank in occupied:
            free[rank // self.per] -= 1
        on = [0] * self.cluster.machines
        for rank in last:
            on[rank // self.per] += 1
        return tuple(sorted(zip(free, on)))

    def bound(self, max_fb, sum_fb, remaining):  # noqa: ANN001, ANN201 - arrays or floats
        """``lower_bound`` vectorised; ``remaining`` is already per remaining device."""
        return np.maximum(self.m1 * max_fb, sum_fb + self.m * remaining)

    # -- the DP ---------------------------------------------------------------------

    def run(self, top: _Top, shallow: bool = False) -> None:
        """The DP over sub-problems in order of planned layers j. ``shallow`` prices only
        the plans of at most two stages (used to order the M candidates)."""
        n = self.t.n
        g = self.cluster.num_devices
        if self.rmax < 1:
            return
        root = _Cand((), (), frozenset(), 0, 0.0, _NEG, _NEG, 0.0, 0.0, _INF, 0.0, _INF)
        self.complete_root(root, top)
        self.shallow = shallow
        if shallow:
            if g >= 2 and n >= 2:
                self.expand(root, g, [dict() for _ in range(n + 1)], top)
            return
        states: list[dict[Any, list[_Cand]]] = [dict() for _ in range(n + 1)]
        states[0][()] = [root]
        # with a beam, successors wait in a bounded heap per j (lowest bounds) and become
        # candidates only when their layer is reached
        self._pending: list[list[tuple]] = [[] for _ in range(n + 1)]
        self._seq = 0
        beam = self.settings.beam
        for j in range(n):
            for entry in self._pending[j]:
                self.insert(states[j], *self._materialise(entry[2]))
            self._pending[j] = []
            layer = [cand for cands in states[j].values() for cand in cands]
            states[j] = {}
            if beam is not None and len(layer) > beam:
                layer = _beam_select(layer, beam)
            for cand in layer:
                if cand.lb >= top.threshold:
                    continue
                free = g - len(cand.occupied)
                if free < 2 or n - j < 2:
                    continue
                self.expand(cand, free, states, top)

    def complete_root(self, root: _Cand, top: _Top) -> None:
        """The one-stage plan: DP over all devices (or the single device)."""
        g = self.cluster.num_devices
        if g > self.rmax or (self.settings.straight_only and g != 1):
            return
        n = self.t.n
        ranks = tuple(range(g))
        s = self.scale(g)
        f, b = self.t.forward[0, n] * s, self.t.backward[0, n] * s
        ar = float(self.exposed(ranks)[0, n])
        mem = self.t.params[0, n] * self.weight_factor + self.k_of(1) * (self.t.stash[0, n] * s)
        if mem > self.cap:
            return
        latency = f + self.m1 * (f + b) + (ar + b)
        top.add(latency, self.m, ((0, n, ranks),))

    def successors(self, occupied: frozenset[int], last: tuple[int, ...] | None, r: int) -> list[_Succ]:
        """The placements the policies offer for r devices after ``occupied`` (DAPPLE 4.2),
        memoised across M."""
        key = (occupied, last, r, self.settings.extended)
        found = self.shared.successors.get(key)
        if found is None:
            state = PlacementState(self.cluster, occupied)
            found = []
            extended = self.settings.extended and self.cluster.num_devices <= EXTENDED_PLACEMENT_DEVICES
            near = last if self.settings.extended else None  # the paper's three policies alone without it
            for _, ranks in placement_options(state, r, near=near, extended=extended):
                taken = occupied.union(ranks)
                rest = tuple(x for x in range(self.cluster.num_devices) if x not in taken)
                found.append(_Succ(r, ranks, taken, rest))
            self.shared.successors[key] = found
        return found

    def expand(self, cand: _Cand, free: int, states: list[dict[Any, list[_Cand]]], top: _Top) -> None:
        """All successors of one sub-problem at once: every replica count r, every placement
        the policies offer and every end J of the new stage, as (pairs x J) arrays."""
        t, n, m1 = self.t, self.t.n, self.m1
        j = cand.end
        k = len(cand.stages)  # index of the new stage
        if cand.smax < k + 2:
            return
        last = cand.last
        boundary = t.output[j - 1] * self.whole if j > 0 else 0.0
        thr = top.threshold
        rmax = self.rmax
        straight = self.settings.straight_only
        can_extend = cand.smax >= k + 3
        sizes = [
            r
            for r in range(1, min(free - 1, rmax) + 1)
            if (not straight or r == 1)
            and ((free - r <= rmax and (not straight or free - r == 1)) or (free - r >= 2 and can_extend))
        ]
        if not sizes:
            return
        # bracket the new stage's end J with parts of the bound: known F+B plus the new
        # stage's (grows with J), (M-1) x the new stage's F+B, known F+B plus M x the work left
        # per remaining device (shrinks with J)
        row = t.work[j, j + 1 : n]
        if thr < _INF:
            s_r = np.array([self.scale(r) for r in sizes])[:, None]
            per_rest = np.array([self.m * self.whole / (free - r) for r in sizes])[:, None]
            room = thr - cand.sum_fb
            fbn_low = row[None, :] * s_r
            mask = (fbn_low < room) & (t.work[j + 1 : n, n][None, :] * per_rest < room)
            if m1 >= 1:
                mask &= m1 * fbn_low < thr
        else:
            mask = np.ones((len(sizes), n - 1 - j), dtype=bool)
        usable = {r: index for index, r in enumerate(sizes) if mask[index].any()}
        if not usable:
            return
        pairs = []
        rows = []
        for r, index in usable.items():
          for succ in self.successors(cand.occupied, last, r):
            if last is not None and boundary > 0:
                c1 = boundary * self.p2p_unit(last, succ.ranks)[0] + self.lat
            else:
                c1 = 0.0
            if m1 >= 1 and m1 * max(cand.max_fb, 2.0 * c1) >= thr:
                continue
            rest = free - succ.r
            complete_ok = rest <= rmax and (not straight or rest == 1)
            extend_ok = rest >= 2 and can_extend
            pairs.append((succ.r, succ.ranks, succ.rest, succ.occupied, c1, succ, complete_ok, extend_ok))
            rows.append(index)
        if not pairs:
            return
        inside_all = mask[rows]
        columns = np.nonzero(inside_all.any(axis=0))[0]
        lo0, hi0 = j + 1 + int(columns[0]), j + 1 + int(columns[-1])
        inside = inside_all[:, columns[0] : columns[-1] + 1]
        J = np.arange(lo0, hi0 + 1)
        rs = [p[0] for p in pairs]
        rests = [len(p[2]) for p in pairs]
        col = lambda values: np.array(values, dtype=float)[:, None]  # noqa: E731
        s_r = col([self.scale(r) for r in rs])
        s_f = col([self.scale(f) if f <= self.rmax else 0.0 for f in rests])
        c1 = col([p[4] for p in pairs])
        complete_ok = np.array([p[6] for p in pairs])[:, None]
        extend_ok = np.array([p[7] for p in pairs])[:, None]
        # the new stage n = [j, J) on `ranks`
        fn = t.forward[j, lo0 : hi0 + 1][None, :] * s_r
        bn = t.backward[j, lo0 : hi0 + 1][None, :] * s_r
        pn = t.params[j, lo0 : hi0 + 1][None, :]
        an = np.stack([self.exposed(p[1])[j, lo0 : hi0 + 1] for p in pairs])
        tmax_n = self.t_max(pn * self.weight_factor, t.stash[j, lo0 : hi0 + 1][None, :] * s_r)
        fbn = fn + bn
        fb1 = 2.0 * c1
        tpl = np.full(fn.shape, _INF)
        if complete_ok.any() and cand.smax >= k + 2:
            tpl = self.complete_rows(cand, k, j, J, pairs, inside & complete_ok, c1, fn, bn, an, tmax_n, s_f, top)
        # successors that stay sub-problems: the layers after J still to be split
        remaining = t.work[lo0 : hi0 + 1, n][None, :] * (self.whole / col(rests))
        max_fb = np.maximum(np.maximum(cand.max_fb, fb1), fbn)
        sum_fb = cand.sum_fb + fb1 + fbn
        lb = self.bound(max_fb, sum_fb, remaining)
        ok = inside & extend_ok & (tmax_n >= 3) & (J[None, :] <= n - 2) & (lb < top.threshold)
        if self.shallow or not ok.any():
            return
        beam = self.settings.beam
        if beam is not None:
            # a sub-problem layer admits only its `beam_insert` lowest bounds; skip the rest
            width = self.settings.beam_insert
            cut = np.array([-self._pending[jj][0][0] if len(self._pending[jj]) >= width else _INF for jj in J.tolist()])
            ok &= lb < cut[None, :]
            if not ok.any():
                return
        pf = cand.pf + c1 + fn
        tail = np.maximum(np.maximum(cand.tail + c1 + bn, c1 + bn), an + bn)
        claim = np.maximum(np.maximum(cand.claim - fb1 - fbn, m1 * fb1 - fbn), m1 * fbn)
        smax = np.minimum(cand.smax, k + tmax_n)
        full = self.settings.keep_per_state
        if beam is not None:
            width = self.settings.beam_insert
            for p, i in zip(*np.nonzero(ok)):
                jj = int(J[i])
                heap = self._pending[jj]
                value = float(lb[p, i])
                if len(heap) >= width and value >= -heap[0][0]:
                    continue
                self._seq += 1
                payload = (
                    cand, j, jj, pairs[p],
                    (float(fn[p, i]), float(bn[p, i]), float(an[p, i]), float(pf[p, i]), float(tail[p, i]), float(claim[p, i]),
                     float(max_fb[p, i]), float(sum_fb[p, i]), float(smax[p, i]), value, float(tpl[p, i])),
                )
                if len(heap) < width:
                    heapq.heappush(heap, (-value, self._seq, payload))
                else:
                    heapq.heapreplace(heap, (-value, self._seq, payload))
            return
        for p, i in zip(*np.nonzero(ok)):
            pair = pairs[p]
            jj = int(J[i])
            succ = pair[5]
            key = succ.key
            if key is None:
                key = succ.key = self.key(succ.occupied, succ.ranks)
            bucket = states[jj].get(key)
            if bucket is not None and len(bucket) >= full:
                worst = bucket[-1]
                # ranks behind every kept candidate and cannot dominate the worst of them
                if tpl[p, i] > worst.tpl and max_fb[p, i] > worst.max_fb:
                    continue
            c = pair[4]
            new = _Cand(
                stages=cand.stages + ((j, jj, pair[1]),),
                phases=cand.phases + (((c, c, 0.0),) if c > 0 else ()) + ((float(fn[p, i]), float(bn[p, i]), float(an[p, i])),),
                occupied=pair[3],
                end=jj,
                pf=float(pf[p, i]),
                tail=float(tail[p, i]),
                claim=float(claim[p, i]),
                max_fb=float(max_fb[p, i]),
                sum_fb=float(sum_fb[p, i]),
                smax=float(smax[p, i]),
                lb=float(lb[p, i]),
                tpl=float(tpl[p, i]),
            )
            self.insert(states[jj], key, new)

    def _materialise(self, payload: tuple) -> tuple[Any, _Cand]:
        """A successor waiting in the beam's heap as (key, candidate)."""
        cand, j, jj, pair, (fn, bn, an, pf, tail, claim, max_fb, sum_fb, smax, lb, tpl) = payload
        succ = pair[5]
        if succ.key is None:
            succ.key = self.key(succ.occupied, succ.ranks)
        c = pair[4]
        new = _Cand(
            stages=cand.stages + ((j, jj, pair[1]),),
            phases=cand.phases + (((c, c, 0.0),) if c > 0 else ()) + ((fn, bn, an),),
            occupied=pair[3],
            end=jj,
            pf=pf,
            tail=tail,
            claim=claim,
            max_fb=max_fb,
            sum_fb=sum_fb,
            smax=smax,
            lb=lb,
            tpl=tpl,
        )
        return succ.key, new

    def exposed(self, ranks: tuple[int, ...]) -> np.ndarray:
        """Exposed AllReduce tail of every layer range [j, J) replicated on ``ranks``
        (``OverlapTables.tail``; ``costs.exposed_tail`` for one stage)."""
        coef, bpm = self.ring(ranks)
        return self.t.overlap.tail(coef / bpm if len(ranks) > 1 else 0.0, self.lat, self.scale(len(ranks)))

    def complete_rows(self, cand, k, j, J, pairs, valid, c1, fn, bn, an, tmax_n, s_f, top) -> np.ndarray:  # noqa: PLR0913
        """Price prefix + new stage [j, J) + the rest as one stage (formula 2, incrementally);
        record the plans that enter the top list; return the latencies (inf if invalid)."""
        t, n, m1 = self.t, self.t.n, self.m1
        lo0, hi0 = int(J[0]), int(J[-1])
        fr = t.forward[lo0 : hi0 + 1, n][None, :] * s_f
        br = t.backward[lo0 : hi0 + 1, n][None, :] * s_f
        pr = t.params[lo0 : hi0 + 1, n][None, :]
        ar = np.stack([self.exposed(p[2])[lo0 : hi0 + 1, n] for p in pairs])
        mem_r = pr * self.weight_factor + self.k_of(1) * (t.stash[lo0 : hi0 + 1, n][None, :] * s_f)
        valid = valid & (tmax_n >= 2) & (mem_r <= self.cap)
        if not valid.any():
            return np.full(fn.shape, _INF)
        out = (t.output[lo0 - 1 : hi0] * self.whole)[None, :]
        units = np.array([self.p2p_unit(p[1], p[2])[0] for p in pairs])[:, None]
        c2 = np.where(out > 0, out * units + self.lat, 0.0)
        fb1, fbn, fb2, fbr = 2.0 * c1, fn + bn, 2.0 * c2, fr + br
        # Algorithm 1 over the new phases (R, c2, n, c1); a = F+B after the phase being
        # checked up to and including the pivot (costs.pivot_stage)
        v = m1 * fbr
        a = fbr + 0.0
        q = np.full(v.shape, 3)
        for code, own_fb in ((2, fb2), (1, fbn), (0, fb1 + 0.0 * v)):
            l1 = m1 * own_fb
            move = l1 > v + a
            v = np.where(move, l1, v)
            a = np.where(move, own_fb, a + own_fb)
            q = np.where(move, code, q)
        b1, b2 = c1, c2
        e_pre = cand.tail
        w0 = cand.pf + c1
        w1 = w0 + fn
        w2 = w1 + c2
        w3 = w2 + fr
        end3 = np.maximum(np.maximum(e_pre + b1 + bn + b2 + br, an + bn + b2 + br), np.maximum(b2 + br, ar + br))
        end2 = np.maximum(np.maximum(e_pre + b1 + bn + b2, an + bn + b2), np.maximum(b2, ar - br))
        end1 = np.maximum(np.maximum(e_pre + b1 + bn, an + bn), np.maximum(-b2, ar - b2 - br))
        end0 = np.maximum(np.maximum(e_pre + b1 + 0.0 * v, an - bn), np.maximum(-bn - b2, ar - bn - b2 - br))
        latency = np.where(q == 3, w3 + v + end3, np.where(q == 2, w2 + v + end2, np.where(q == 1, w1 + v + end1, w0 + v + end0)))
        if cand.stages:
            hs, data = cand.records(m1)
            rec_h = np.array(hs)
            idx = np.searchsorted(rec_h, v + a, side="right")
            inner = idx < rec_h.size
            if inner.any():
                ii = np.minimum(idx, rec_h.size - 1)
                rec_ws = np.array([d[0] for d in data])[ii]
                rec_e = np.array([d[1] for d in data])[ii]
                bq = np.array([d[2] for d in data])[ii]
                end_in = np.maximum(np.maximum(rec_e, an - bq - b1 - bn), ar - bq - b1 - bn - b2 - br)
                latency = np.where(inner, rec_ws + end_in, latency)
        latency = np.where(valid, latency, _INF)
        thr = top.threshold
        for p, i in zip(*np.nonzero(latency < thr)):
            pair = pairs[p]
            jj = int(J[i])
            top.add(float(latency[p, i]), self.m, cand.stages + ((j, jj, pair[1]), (jj, n, pair[2])))
        return latency

    def insert(self, bucket: dict[Any, list[_Cand]], key: Any, new: _Cand) -> None:
        """Keep the ``keep_per_state`` best (``_rank``) non-dominated candidates, sorted."""
        cands = bucket.get(key)
        if cands is None:
            bucket[key] = [new]
            return
        for old in cands:
            if _dominates(old, new):
                return
        kept = [old for old in cands if not _dominates(new, old)]
        kept.append(new)
        kept.sort(key=_rank)
        del kept[self.settings.keep_per_state :]
        bucket[key] = kept


# --------------------------------------------------------------------------- public API


def _to_stages(raw: RawStages) -> tuple[StagePlan, ...]:
    return tuple(StagePlan(layers=(a, b), devices=tuple(sorted(devices))) for a, b, devices in raw)


EXTENDED_PLACEMENT_DEVICES = 16  # beyond this, only the paper's policies plus append_near
SMALL_INSTANCE = 256  # layers x devices up to which the search keeps everything it can


def search_effort(num_layers: int, num_devices: int, keep_per_state: int | None = None, beam: int | None | str = "auto") -> tuple[int, int | None]:
    """(candidates kept per sub-problem, sub-problems expanded per layer) for an instance.

    Small instances (layers x devices <= 256, which covers every exhaustive check) keep four
    non-dominated candidates per sub-problem and no beam: the search then matches brute force
    (tests/test_planner_optimality.py). Larger ones keep two and expand, per number of
    planned layers j, only 16 sub-problems (8 beyond 4096 layers x devices), half with the
    lowest bound and half with the lowest T_PL, admitting 4x as many; the best results are
    then polished by local edits (``polish``). This keeps BERT-48 on 16 devices around a
    second and 128 layers on 64 devices under ten, at a cost of a few percent of formula
    latency on the hardest Table 4 cases (benchmarks/bench_planner.py measures it).
    """
    small = num_layers * num_devices <= SMALL_INSTANCE
    if keep_per_state is None:
        keep_per_state = 4 if small else 2
    if beam == "auto":
        beam = None if small else (16 if num_layers * num_devices <= 4 * 1024 else 8)
    if beam is not None and (not isinstance(beam, int) or beam < 1):
        raise DappleConfigError("beam", f"must be a positive integer, None or 'auto', got {beam!r}", "leave it at 'auto'")
    if not isinstance(keep_per_state, int) or keep_per_state < 1:
        raise DappleConfigError("keep_per_state", f"must be a positive integer, got {keep_per_state!r}", "leave it out")
    return keep_per_state, beam  # type: ignore[return-value]


def lower_bound(micro_batches: int, max_fb: float, sum_fb: float, work_left: float, devices_left: int) -> float:
    """Formula 2 is at least this for any plan that starts with a given prefix of stages:
    ``max_fb`` / ``sum_fb`` are the max and sum of F+B over the prefix's stages and
    transfers, ``work_left`` the F+B of the remaining layers at the full micro-batch on one
    device (see the module docstring for the proof)."""
    per_device = work_left / devices_left if devices_left else 0.0
    return max((micro_batches - 1) * max_fb, sum_fb + micro_batches * per_device)


def dapple_search(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    min_slice: int | None = None,
    keep: int = 4,
    keep_per_state: int | None = None,
    straight_only: bool = False,
    extended_placement: bool = True,
    beam: int | None | str = "auto",
) -> list[Scored]:
    """The ``keep`` best plans under formula 2 that fit in memory, best first.

    ``cluster`` must already be the device set to plan for (see ``subcluster``). Every plan
    returned is re-priced with ``score_stages`` (the official cost model). The search effort
    (``keep_per_state``, ``beam``) defaults by instance size, see ``search_effort``.
    """
    check_inputs(schedule, policy, global_batch_size)
    floor = default_min_slice(profile, min_slice)
    candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
    keep_per_state, beam = search_effort(profile.num_layers, cluster.num_devices, keep_per_state, beam)
    tables = _Tables(profile)
    settings = _Settings(policy=policy, schedule=schedule, keep_per_state=keep_per_state, straight_only=straight_only, extended=extended_placement, beam=beam)
    top = _Top(keep)
    shared = _Shared()
    total_work = float(tables.work[0, tables.n])
    g = cluster.num_devices

    def bound(m: int) -> float:
        # no plan beats M x (all work of one micro-batch) / G (lower_bound with an empty prefix)
        return m * total_work * ((global_batch_size // m) / tables.pbs) / g

    # Order the M candidates by a cheap probe (plans of at most two stages; with a beam also
    # a greedy deep search keeping one sub-problem per layer), so that the full searches
    # start with a tight bound and the later M are pruned hard.
    searches = {m: _Search(tables, cluster, global_batch_size, m, floor, settings, shared) for m in candidates}
    probe_settings = replace(settings, keep_per_state=1, beam=1) if beam is not None else None
    probe_best: dict[int, float] = {}
    for m, search in searches.items():
        probe = _Top(1)
        search.run(probe, shallow=True)
        if probe_settings is not None:
            _Search(tables, cluster, global_batch_size, m, floor, probe_settings, shared).run(probe)
        probe_best[m] = probe.items[0][0] if probe.items else _INF
        for latency, _, mm, raw in probe.items:
            top.add(latency, mm, raw)
    for m in sorted(candidates, key=lambda m: (probe_best[m], m)):
        if bound(m) >= top.threshold:
            continue
        searches[m].run(top)
    scored = []
    for _, _, m, raw in top.items:
        item = score_stages(profile, cluster, _to_stages(raw), global_batch_size, m, policy, schedule)
        if item.fits(cluster):
            scored.append(item)
    if beam is not None and scored and not straight_only:
        # the beam may have cut the way to a better plan: polish the best ones locally
        polished = [polish(profile, cluster, item, global_batch_size, policy, schedule, floor, tables=tables) for item in scored[:2]]
        known = {(item.micro_batches, item.stages) for item in scored}
        scored.extend(item for item in polished if (item.micro_batches, item.stages) not in known)
    scored.sort(key=lambda item: (item.latency_ms, len(item.stages), item.micro_batches))
    return scored


def _consecutive(shape: Sequence[tuple[int, int, int]]) -> tuple[StagePlan, ...]:
    stages = []
    rank = 0
    for a, b, r in shape:
        stages.append(StagePlan(layers=(a, b), devices=tuple(range(rank, rank + r))))
        rank += r
    return tuple(stages)


class _QuickCost:
    """The StageCost fields formula 2 and the memory model read, from the range tables
    (the same sums as ``stage_costs``); used to score many small edits quickly. Any other
    field (recomputation time, ...) reads as 0, which is what a plan without
    recomputation has."""

    __slots__ = ("forward_ms", "backward_ms", "exposed_allreduce_ms", "send_ms", "param_bytes", "stash_bytes")

    def __getattr__(self, name: str) -> float:
        if name.startswith("__"):
            raise AttributeError(name)
        return 0.0

    def __init__(self, forward_ms: float, backward_ms: float, exposed_allreduce_ms: float, send_ms: float, param_bytes: float, stash_bytes: float) -> None:
        self.forward_ms = forward_ms
        self.backward_ms = backward_ms
        self.exposed_allreduce_ms = exposed_allreduce_ms
        self.send_ms = send_ms
        self.param_bytes = param_bytes
        self.stash_bytes = stash_bytes


def _exposed_ms(tables: _Tables, cluster: Cluster, stage: StagePlan, per_device: float) -> float:
    """The stage's exposed AllReduce tail from the overlap tables."""
    if stage.replicas <= 1:
        return 0.0
    coef = 2.0 * (stage.replicas - 1) / stage.replicas
    a = coef / cluster.bytes_per_ms(cluster.ring_bandwidth_gbps(stage.devices))
    return float(tables.overlap.tail(a, cluster.latency_ms, per_device)[stage.start, stage.end])


def _quick_latency(tables: _Tables, cluster: Cluster, stages: Sequence[StagePlan], mbs: int, m: int, policy: str, schedule: str) -> tuple[float, bool]:
    """(formula-2 latency, fits in memory) of ``stages`` priced from the tables."""
    whole = mbs / tables.pbs
    costs = []
    for index, stage in enumerate(stages):
        a, b = stage.layers
        per_device = slice_size(mbs, stage.replicas) / tables.pbs
        send = 0.0
        if index + 1 < len(stages):
            send = p2p_ms_fast(cluster, tables.output[b - 1] * whole, stage.devices, stages[index + 1].devices)
        params = float(tables.params[a, b])
        costs.append(
            _QuickCost(
                float(tables.forward[a, b]) * per_device,
                float(tables.backward[a, b]) * per_device,
                _exposed_ms(tables, cluster, stage, per_device),
                send,
                params,
                float(tables.stash[a, b]) * per_device,
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
    tables: "_Tables | None" = None,
) -> Scored:
    """Hill-climb from a DP result with small edits, keeping what formula 2 likes better.

    Used after a beam-limited search (large instances), where the beam may have dropped the
    prefix of a better plan: shift a stage boundary by 1, 2, 4 or 8 layers, move one replica
    between two stages, merge two neighbours, or split a replicated stage in two. Edits that
    change replica counts place stages on consecutive ranks; every candidate is priced with
    ``score_stages`` and must fit in memory with slices of at least ``min_slice`` samples.
    """
    tables = tables or _Tables(profile)
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
                    edited[i] = StagePlan((edited[i].start, cut), edited[i].devices)
                    edited[i + 1] = StagePlan((cut, edited[i + 1].end), edited[i + 1].devices)
                    options.append(tuple(edited))
        for i in range(len(shape)):
            for k in range(len(shape)):
                if i != k and shape[i][2] >= 2 and shape[k][2] + 1 <= rmax:
                    edited_shape = list(shape)
                    edited_shape[i] = (shape[i][0], shape[i][1], shape[i][2] - 1)
                    edited_shape[k] = (shape[k][0], shape[k][1], shape[k][2] + 1)
                    options.append(_consecutive(edited_shape))
            if i + 1 < len(shape) and shape[i][2] + shape[i + 1][2] <= rmax:
                options.append(_consecutive(shape[:i] + [(shape[i][0], shape[i + 1][1], shape[i][2] + shape[i + 1][2])] + shape[i + 2 :]))
            a, b, r = shape[i]
            if r >= 2 and b - a >= 2:
                mid = (a + b) // 2
                options.append(_consecutive(shape[:i] + [(a, mid, r // 2), (mid, b, r - r // 2)] + shape[i + 1 :]))
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
    return score_stages(profile, cluster, best_stages, global_batch_size, m, policy, schedule)





def _balanced_cuts(tables: _Tables, cluster: Cluster, devices: Sequence[tuple[int, ...]], mbs: int) -> list[int] | None:
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
    for s in range(count):
        scale = slice_size(mbs, len(devices[s])) / tables.pbs
        nxt = np.full(n + 1, _INF)
        unit = p2p_ms_fast(cluster, 1e6, devices[s], devices[s + 1]) / 1e6 if s + 1 < count else 0.0
        ends = range(s + 1, n - (count - s - 1) + 1) if s + 1 < count else [n]
        for c in ends:
            starts = np.arange(s, c)
            stage_time = tables.work[starts, c] * scale
            send = 2.0 * tables.output[c - 1] * whole * unit if s + 1 < count else 0.0
            value = np.maximum(np.maximum(best[starts], stage_time), send)
            k = int(np.argmin(value))
            nxt[c] = value[k]
            choice[s, c] = starts[k]
        best = nxt
    if best[n] == _INF:
        return None
    cuts = [n]
    for s in range(count - 1, 0, -1):
        cuts.append(int(choice[s, cuts[-1]]))
    cuts.append(0)
    return cuts[::-1]


def balanced_variant(
    profile: ModelProfile,
    cluster: Cluster,
    item: Scored,
    global_batch_size: int,
    policy: str = "PA",
    schedule: str = "dapple",
) -> Scored | None:
    """The same stages on the same devices with evenly balanced layer cuts
    (``_balanced_cuts``), or None if that is the same plan or does not fit in memory.

    Formula 2 tolerates a stage before the pivot that is heavier than the pivot as long as
    enough work lies between them (Algorithm 1), and its best plans can be slightly uneven
    (4.4); the simulator, which re-ranks the candidates, sometimes prefers the evenly
    balanced cut. Offering both lets the simulation decide.
    """
    stages = item.stages
    if len(stages) < 2:
        return None
    tables = _Tables(profile)
    cuts = _balanced_cuts(tables, cluster, [stage.devices for stage in stages], global_batch_size // item.micro_batches)
    if cuts is None:
        return None
    new = tuple(StagePlan(layers=(cuts[s], cuts[s + 1]), devices=stage.devices) for s, stage in enumerate(stages))
    if new == stages:
        return None
    scored = score_stages(profile, cluster, new, global_batch_size, item.micro_batches, policy, schedule)
    return scored if scored.fits(cluster) else None


def data_parallel_candidates(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    min_slice: int | None = None,
) -> list[Scored]:
    """DP (one stage on all devices) at every valid M, fitting or not, best first."""
    floor = default_min_slice(profile, min_slice)
    candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
    g = cluster.num_devices
    stage = (StagePlan(layers=(0, profile.num_layers), devices=tuple(range(g))),)
    out = [
        score_stages(profile, cluster, stage, global_batch_size, m, policy, schedule)
        for m in candidates
        if g <= min((global_batch_size // m) // floor, global_batch_size // m)
    ]
    return sorted(out, key=lambda item: (not item.fits(cluster), item.latency_ms, item.micro_batches))


def straight_candidates(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    min_slice: int | None = None,
    keep: int = 1,
) -> list[Scored]:
    """The straight pipeline (G stages, one device each, ranks in order) that fits in memory.

    For every candidate M the layers are cut to minimise the slowest stage
    (``_balanced_cuts``); the plans are ranked by formula 2. Needs at least G layers. (The
    DP restricted to one replica per stage, ``dapple_search(straight_only=True)``, finds the
    formula's best straight cut instead; it is slower and the simulator often prefers the
    balanced one.)
    """
    g = cluster.num_devices
    if profile.num_layers < g:
        return []
    floor = default_min_slice(profile, min_slice)
    candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
    tables = _Tables(profile)
    devices = [(rank,) for rank in range(g)]
    out = []
    for m in candidates:
        mbs = global_batch_size // m
        if mbs // floor < 1:
            continue
        cuts = _balanced_cuts(tables, cluster, devices, mbs)
        if cuts is None:
            continue
        stages = tuple(StagePlan(layers=(cuts[s], cuts[s + 1]), devices=devices[s]) for s in range(g))
        item = score_stages(profile, cluster, stages, global_batch_size, m, policy, schedule)
        if item.fits(cluster):
            out.append(item)
    out.sort(key=lambda item: (item.latency_ms, item.micro_batches))
    return out[:keep]


def _smallest_memory(profile: ModelProfile, cluster: Cluster, global_batch_size: int, micro_batches: int | None, schedule: str, policy: str, min_slice: int | None) -> tuple[float, str]:
    """Peak per-device memory of the least memory-hungry plan we can name cheaply.

    Over every M and every number of stages S <= min(N, G): the straight partition whose
    largest per-device memory (weights, gradients, optimizer state and K_i stashed slices)
    is smallest, found by a bottleneck DP built from the last stage backwards (K_i depends on
    how many stages follow). Spare devices would only add replicas, which never add memory.
    """
    floor = default_min_slice(profile, min_slice)
    candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
    tables = _Tables(profile)
    n, g = tables.n, cluster.num_devices
    best = (_INF, "")
    for m in candidates:
        search = _Search(tables, cluster, global_batch_size, m, floor, _Settings(policy, schedule, 1))
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
                    mem = tables.params[a, b] * search.weight_factor + kk * (tables.stash[a, b] * s1)
                    cur[a] = min(cur[a], max(mem, prev[b]))
            prev = cur
            if cur[0] < best[0]:
                best = (cur[0], f"{stages} stage{'s' if stages > 1 else ''}, M={m}")
    return best


def plan_dapple(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    num_devices: int | None = None,
    min_slice: int | None = None,
    rerank: int = 4,
    keep_per_state: int | None = None,
    beam: int | None | str = "auto",
) -> Plan:
    """Plan ``profile`` on all devices of ``cluster`` with DAPPLE's planner (section 4).

    Returns the plan JSON the runtime executes: stages, M, K_i (5.3), ``predicted`` (formula
    phases, pivot, per-device memory, simulated latency and bubble) and a one-line ``reason``.
    Raises ``DappleConfigError`` when no plan is valid or none fits in device memory.
    """
    check_inputs(schedule, policy, global_batch_size)
    cluster = subcluster(cluster, num_devices)
    best = dapple_search(
        profile, cluster, global_batch_size, micro_batches, schedule, policy, min_slice, keep=max(rerank, 1), keep_per_state=keep_per_state, beam=beam
    )
    dp_all = data_parallel_candidates(profile, cluster, global_batch_size, micro_batches, schedule, policy, min_slice)
    dp = [item for item in dp_all if item.fits(cluster)][:1]
    straight = straight_candidates(profile, cluster, global_batch_size, micro_batches, schedule, policy, min_slice)
    pool: list[Scored] = []
    seen: set[tuple[int, tuple[StagePlan, ...]]] = set()
    shortlist = [*best[: max(rerank, 1)], *straight]
    if rerank > 0:
        balanced = [balanced_variant(profile, cluster, item, global_batch_size, policy, schedule) for item in shortlist]
        shortlist += [item for item in balanced if item is not None]
    for item in [*shortlist, *dp]:
        key = (item.micro_batches, item.stages)
        if key not in seen:
            seen.add(key)
            pool.append(item)
    if not pool:
        need, what = _smallest_memory(profile, cluster, global_batch_size, micro_batches, schedule, policy, min_slice)
        if need == _INF:
            floor = default_min_slice(profile, min_slice)
            raise DappleConfigError(
                "global_batch_size",
                f"no valid plan puts {profile.num_layers} layers on {cluster.num_devices} devices with micro-batch slices of at least {floor} samples",
                "use a larger global batch, fewer devices (num_devices), or a smaller slice floor (min_slice)",
            )
        raise_no_memory(profile, cluster, need, what)
    simulations: dict[int, Any] = {}
    if rerank > 0:
        for index, item in enumerate(pool):
            simulations[index] = simulate_or_none(_bare_plan(item, global_batch_size, schedule, policy), profile, cluster)
    have_sim = bool(simulations) and all(sim is not None for sim in simulations.values())

    def rank(index: int) -> tuple[float, float, int]:
        item = pool[index]
        simulated = simulations[index].latency_ms if have_sim else item.latency_ms
        return (simulated, item.latency_ms, len(item.stages))

    chosen_index = min(range(len(pool)), key=rank) if have_sim else min(range(len(pool)), key=lambda i: (pool[i].latency_ms, len(pool[i].stages)))
    chosen = pool[chosen_index]
    sim = simulations.get(chosen_index)
    dp_pair = _pair_for(pool, simulations, dp)
    straight_pair = _pair_for(pool, simulations, straight)
    pipelines = [i for i in range(len(pool)) if len(pool[i].stages) > 1]
    runner_up = None
    if pipelines:
        index = min(pipelines, key=rank) if have_sim else min(pipelines, key=lambda i: pool[i].latency_ms)
        runner_up = (pool[index], simulations.get(index))
    reason = describe_choice(chosen, sim, cluster, dp_pair, straight_pair, dp_all, runner_up)
    extra = {
        "alternatives": {
            name: _summary(pair)
            for name, pair in (("dp", dp_pair), ("straight", straight_pair))
            if pair is not None
        },
        "min_slice": default_min_slice(profile, min_slice),
    }
    return finish_plan(chosen, profile, cluster, global_batch_size, policy, schedule, "dapple", reason, sim, extra)


def _bare_plan(item: Scored, global_batch_size: int, schedule: str, policy: str) -> Plan:
    return Plan(global_batch_size=global_batch_size, micro_batches=item.micro_batches, stages=item.stages, schedule=schedule, policy=policy)


def _pair_for(pool: list[Scored], simulations: dict[int, Any], wanted: list[Scored]) -> tuple[Scored, Any] | None:
    if not wanted:
        return None
    for index, item in enumerate(pool):
        if item.micro_batches == wanted[0].micro_batches and item.stages == wanted[0].stages:
            return item, simulations.get(index)
    return wanted[0], None


def _summary(pair: tuple[Scored, Any]) -> dict[str, Any]:
    item, sim = pair
    out: dict[str, Any] = {
        "kind": item.kind(),
        "micro_batches": item.micro_batches,
        "latency_ms": item.latency_ms,
        "split": [stage.end - stage.start for stage in item.stages],
    }
    if sim is not None:
        out["simulated_latency_ms"] = float(sim.latency_ms)
    return out


def _latency(pair: tuple[Scored, Any] | tuple[Scored, None]) -> float:
    item, sim = pair
    return float(sim.latency_ms) if sim is not None else item.latency_ms


def _bubble_ms(item: Scored, sim: Any) -> float:
    """Idle time per device: simulated bubble share x latency, else the formula's L - M(F_Q+B_Q)."""
    if sim is not None:
        return float(sim.bubble_fraction) * float(sim.latency_ms)
    costs = item.costs
    q = item.prediction.pivot_stage
    return item.latency_ms - item.micro_batches * (costs[q].forward_ms + costs[q].backward_ms)


def _split_text(stages: Sequence[StagePlan]) -> str:
    return ":".join(str(stage.end - stage.start) for stage in stages)


def describe_choice(
    chosen: Scored,
    sim: Any,
    cluster: Cluster,
    dp: tuple[Scored, Any] | None,
    straight: tuple[Scored, Any] | None,
    dp_all: Sequence[Scored] = (),
    runner_up: tuple[Scored, Any] | None = None,
) -> str:
    """One line saying why this plan, from the numbers (DAPPLE 6.2 style): DP is compared
    with the best pipeline (``runner_up``), a pipeline with DP and the straight pipeline."""
    kind = chosen.kind()
    latency = _latency((chosen, sim))
    where = "simulated" if sim is not None else "formula"
    if kind == "single":
        return f"single device: nothing to split or replicate ({latency:.1f} ms per step, {where})"
    if kind == "DP":
        ar = chosen.costs[0].allreduce_ms
        params = chosen.costs[0].param_bytes
        bw = cluster.ring_bandwidth_gbps(chosen.stages[0].devices)
        text = f"DP: AllReduce of {format_bytes(params)} over {bw:g} Gbit/s costs {ar:.1f} ms"
        if runner_up is not None:
            other, other_sim = runner_up
            label = "straight" if other.kind() == "straight" else other.kind()
            text += (
                f", less than the bubble of the best pipeline ({label}, {_bubble_ms(other, other_sim):.1f} ms): "
                f"{latency:.1f} vs {_latency(runner_up):.1f} ms per step ({where})"
            )
        else:
            text += f" ({latency:.1f} ms per step, {where}); no valid pipeline fits"
        return text
    label = "straight pipeline" if kind == "straight" else f"{kind} pipeline"
    text = f"{label} (layers {_split_text(chosen.stages)}, M={chosen.micro_batches})"
    if dp is not None:
        dp_item, dp_sim = dp
        ar = dp_item.costs[0].allreduce_ms
        bw = cluster.ring_bandwidth_gbps(dp_item.stages[0].devices)
        text += (
            f": AllReduce of {format_bytes(dp_item.costs[0].param_bytes)} over {bw:g} Gbit/s would cost {ar:.1f} ms under DP "
            f"({_latency(dp):.1f} ms per step), the pipeline's bubble costs {_bubble_ms(chosen, sim):.1f} ms ({latency:.1f} ms per step, {where})"
        )
    elif dp_all:
        need = dp_all[0].peak_memory_bytes
        text += f": DP needs {format_gib(need)} per device, more than {cluster.device_memory_gib:g} GiB; this plan takes {latency:.1f} ms per step ({where})"
    else:
        text += f": DP is not valid here (slices would fall below the floor); {latency:.1f} ms per step ({where})"
    if straight is not None and kind != "straight":
        text += f"; straight: {_latency(straight):.1f} ms"
    return text
