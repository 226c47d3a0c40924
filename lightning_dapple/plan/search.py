"""One run of DAPPLE's dynamic programme (4.3, formulas 4-5) for a fixed M.

See ``dapple_planner`` for the search as a whole. A sub-problem has planned the first j
layers as complete stages (a ``PartialPlan``); ``expand_layer`` prices, with arrays, every
next stage of every sub-problem of layer j at once -- every replica count r, every
placement the policies of 4.2 offer and every end J -- both as the plan's last-but-one
stage with the rest as one final stage (``_batch_complete``: the paper's T_PL, formula 2
computed incrementally) and as a new sub-problem to split further (``_batch_extend``).

``SearchSettings.zero`` prices every replicated stage of the run at that ZeRO level
(``costs.py``: each replica's share of the optimizer state, and under 2 of the gradients; the
step's share, the parameter exchange and the reduce); the planner runs the search once per
level it may use and lets ``zero_choice`` mix levels per stage afterwards.

This module is long because the vectorised DP shares its memo tables, its per-layer
batches and its bound between the steps of one layer; split apart, every piece would
have to carry all of them.

The module is long because the dynamic programme's vectorised expansion (every replica count,
placement and end of every sub-problem at once) keeps its array steps together, in the order
formulas 4-5 combine them; split, the steps would pass a dozen arrays between modules.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import slice_size, weight_state_factor
from lightning_dapple.plan.partial import (
    PartialPlan,
    TopPlans,
    beam_select,
    dominates,
    rank,
)
from lightning_dapple.plan.placement import PlacementState, placement_options
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.plan.search_tables import RangeTables, p2p_ms_fast

__all__ = ["EXTENDED_PLACEMENT_DEVICES", "SearchSettings", "SharedMemo", "StageSearch"]

_INF = float("inf")
_NEG = float("-inf")
EXTENDED_PLACEMENT_DEVICES = 16  # beyond this, only the paper's policies plus append_near


@dataclass
class SearchSettings:
    policy: str
    schedule: str
    keep_per_state: int
    straight_only: bool = False
    extended: bool = True
    beam: int | None = None
    zero: int = 0  # the ZeRO level of every replicated stage (costs.py)

    @property
    def beam_insert(self) -> int:
        """Sub-problems admitted per layer when a beam is set (more than are expanded)."""
        return 4 * (self.beam or 0)


@dataclass(eq=False, slots=True)
class Successor:
    """One placement of a next stage: its ranks, what is left, and the new state's key."""

    r: int
    ranks: tuple[int, ...]
    occupied: frozenset[int]
    rest: tuple[int, ...]
    key: Any = None  # filled when first needed
    unit_in: float = 0.0  # p2p unit from the previous stage's ranks (0 for the first stage)
    unit_rest: float | None = None  # p2p unit from these ranks to the rest, when first needed
    ring_ranks: int = -1  # ``SharedMemo.ring_id`` of the ranks
    ring_rest: int = -1  # ... and of the rest


class SuccessorBlock:
    """Every placement offered after one placement state (occupied ranks, last stage's
    ranks) for the replica counts asked so far, as rows in the order ``_part`` visits them
    (replica count, then policy), with the per-row numbers it prices as arrays, so that a
    sub-problem's successors are selected and priced without a Python loop per placement."""

    __slots__ = ("by_r", "rows", "r", "unit_in", "rest_len", "ring", "ring_rest", "selections")

    def __init__(self) -> None:
        self.by_r: dict[int, list[Successor]] = {}
        self.rebuild()

    def select(self, wanted: list[int], sizes: list[int]) -> "_Selection":
        """The rows whose replica count is ``wanted`` (in row order), with their numbers and
        their counts' positions in ``sizes``; memoised until the rows change."""
        key = (tuple(wanted), tuple(sizes))
        found = self.selections.get(key)
        if found is None:
            chosen = np.zeros(max(max(self.by_r), max(wanted)) + 1, dtype=bool)
            chosen[wanted] = True
            rows = np.flatnonzero(chosen[self.r])
            replicas = self.r[rows]
            found = self.selections[key] = _Selection(
                rows, self.unit_in[rows], replicas, np.searchsorted(sizes, replicas), [self.rows[i] for i in rows.tolist()],
                self.rest_len[rows], self.ring[rows], self.ring_rest[rows],
            )
        return found

    def rebuild(self) -> None:
        """Rows and arrays after replica counts were added (rows sorted by replica count)."""
        rows = [succ for r in sorted(self.by_r) for succ in self.by_r[r]]
        self.rows = rows
        self.r = np.array([succ.r for succ in rows], dtype=np.intp)
        self.unit_in = np.array([succ.unit_in for succ in rows], dtype=float)
        self.rest_len = np.array([len(succ.rest) for succ in rows], dtype=np.intp)
        self.ring = np.array([succ.ring_ranks for succ in rows], dtype=np.intp)
        self.ring_rest = np.array([succ.ring_rest for succ in rows], dtype=np.intp)
        self.selections: dict[tuple[tuple[int, ...], tuple[int, ...]], _Selection] = {}


class _Selection(NamedTuple):
    """Some rows of a ``SuccessorBlock`` (``rows``) and, row by row, their transfer units in,
    replica counts and those counts' positions in the sub-problem's replica counts,
    successors, rest sizes and ring ids of their ranks and of the rest."""

    rows: np.ndarray
    unit_in: np.ndarray
    replicas: np.ndarray
    mask_rows: np.ndarray
    succs: list[Successor]
    rest: np.ndarray
    ring: np.ndarray
    ring_rest: np.ndarray

    def subset(self, index: np.ndarray) -> "_Selection":
        """The rows at positions ``index`` of this selection."""
        return _Selection(
            self.rows[index], self.unit_in[index], self.replicas[index], self.mask_rows[index], [self.succs[i] for i in index.tolist()],
            self.rest[index], self.ring[index], self.ring_rest[index],
        )


class SharedMemo:
    """Memo tables that do not depend on M: placements offered per placement state,
    transfer units per machine pattern, ring AllReduce parameters."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, SuccessorBlock] = {}
        self.p2p: dict[tuple, tuple[float, float]] = {}
        self.senders: dict[tuple[int, ...], tuple[dict[int, int], tuple[int, ...]]] = {}
        self.rings: dict[tuple[int, ...], tuple[float, float]] = {}
        self.ring_ids: dict[tuple[int, float], int] = {}
        self.ring_keys: list[tuple[int, float]] = []
        self.options: dict[tuple, list[tuple]] = {}
        self.ring_of_shape: dict[tuple[int, bool], int] = {}
        self.states: dict[frozenset[int], PlacementState] = {}

    def ring_id(self, key: tuple[int, float]) -> int:
        """A small integer naming a ring key (``StageSearch.ring_key``), for array lookups."""
        found = self.ring_ids.get(key)
        if found is None:
            found = self.ring_ids[key] = len(self.ring_keys)
            self.ring_keys.append(key)
        return found


class StageSearch:
    """One DP run for a fixed number of micro-batches M."""

    def __init__(self, tables: RangeTables, cluster: Cluster, global_batch_size: int, micro_batches: int, min_slice: int, settings: SearchSettings, shared: SharedMemo | None = None) -> None:
        self.shared = shared or SharedMemo()
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
        self.weight_factor = 2.0 + cluster.optimizer_state_factor  # bytes held per parameter byte, one replica
        # ... per replica count r (index), at the run's ZeRO level
        self._weight_factors = np.array(
            [weight_state_factor(r, settings.zero, cluster.optimizer_state_factor) for r in range(cluster.num_devices + 1)]
        )
        self.lat = cluster.latency_ms  # per transfer
        self.ring_lat = cluster.ring_latency_ms  # per AllReduce, by replica count
        self.per = cluster.devices_per_machine
        self._scales = [0.0] + [slice_size(self.mbs, r) / tables.pbs for r in range(1, cluster.num_devices + 1)]
        self._scale_array = np.array(self._scales)
        self._exposed: dict[tuple[int, float], np.ndarray] = {}
        self._exposed_ids: dict[int, np.ndarray] = {}
        self._exposed_first: dict[int, np.ndarray] = {}  # row 0 by ring id, where the table is not needed
        self._last = np.zeros((0, tables.n + 1))  # [ring id, J]: exposed tail of [J, n)
        self._last_have = np.zeros(0, dtype=bool)
        self._sizes: dict[tuple[int, bool], list[int]] = {}
        self._brackets: dict[tuple[int, int, tuple[int, ...]], tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    # -- cost helpers (the formulas of costs.py / cluster.py, vectorised) --------------

    def scale(self, replicas: int) -> float:
        """A replica's slice of a micro-batch, in profile batches (memoised)."""
        return self._scales[replicas]

    def k_of(self, t: int) -> int:
        """K_i of a stage with ``t`` stages from it to the end (itself included)."""
        if schedule_spec(self.settings.schedule).holds_every_micro_batch:
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
        if schedule_spec(self.settings.schedule).holds_every_micro_batch:
            return np.where(kmax >= self.m, _INF, -1.0)
        if self.settings.policy == "PA":
            return np.where(kmax >= self.m, _INF, kmax)
        return np.where(kmax >= self.m, _INF, np.floor((kmax + 1) / 2))

    def tmax_rows(self, j: int, replicas: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """``t_max`` of the stages [j, J) for J in [lo, hi) (columns), one row per entry of
        ``replicas``, each distinct replica count priced once."""
        distinct, inverse = _distinct(replicas)
        t = self.t
        weights = t.params[j, lo:hi][None, :] * self._weight_factors[distinct][:, None]
        table = self.t_max(weights, t.stash_bytes(j, slice(lo, hi), self._scale_array[distinct][:, None]))
        return table[inverse]

    def p2p_unit(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> tuple[float, float]:
        """``p2p_ms`` is ``bytes * unit + latency`` for any positive byte count (memoised
        across M; equal to ``p2p_ms`` up to rounding, and plans are re-priced exactly)."""
        # the search's senders and receivers are disjoint (a stage's ranks are free when it
        # is placed), so p2p_ms depends only on which of them share a machine: every
        # split-concat piece's route and each sender's and receiver's byte sums are the same,
        # and the per-machine sums only trade places when machines are renamed. Machines are
        # therefore named by first appearance (senders, then receivers).
        per = self.per
        named = self.shared.senders.get(senders)
        if named is None:  # the senders' names, once per rank tuple (a stage sends to many)
            first: dict[int, int] = {}
            named = self.shared.senders[senders] = (first, tuple([first.setdefault(device // per, len(first)) for device in senders]))
        names = named[0].copy()
        key = (named[1], tuple([names.setdefault(device // per, len(names)) for device in receivers]))
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
        for device in occupied:
            free[device // self.per] -= 1
        on = [0] * self.cluster.machines
        for device in last:
            on[device // self.per] += 1
        return tuple(sorted(zip(free, on)))

    def bound(self, max_fb, sum_fb, remaining):  # noqa: ANN001, ANN201 - arrays or floats
        """``lower_bound`` vectorised; ``remaining`` is already per remaining device."""
        return np.maximum(self.m1 * max_fb, sum_fb + self.m * remaining)

    # -- the DP ---------------------------------------------------------------------

    def run(self, top: TopPlans, shallow: bool = False) -> None:
        """The DP over sub-problems in order of planned layers j. ``shallow`` prices only
        the plans of at most two stages (used to order the M candidates)."""
        n = self.t.n
        g = self.cluster.num_devices
        if self.rmax < 1:
            return
        root = PartialPlan((), (), frozenset(), 0, 0.0, _NEG, _NEG, 0.0, 0.0, _INF, 0.0, _INF)
        self.complete_root(root, top)
        self.shallow = shallow
        if shallow:
            if g >= 2 and n >= 2:
                self.expand_layer(0, [root], [dict() for _ in range(n + 1)], top, check_bound=False)
            return
        states: list[dict[Any, list[PartialPlan]]] = [dict() for _ in range(n + 1)]
        states[0][()] = [root]
        # with a beam, successors wait in a bounded heap per j (lowest bounds) and become
        # candidates only when their layer is reached
        self._pending: list[list[tuple]] = [[] for _ in range(n + 1)]
        self._cut = np.full(n + 1, _INF)  # per end: the worst bound in its heap once full, else inf
        self._seq = 0
        beam = self.settings.beam
        for j in range(n):
            for entry in self._pending[j]:
                self.insert(states[j], *self._materialise(entry[2]))
            self._pending[j] = []
            self._cut[j] = _INF
            layer = [cand for cands in states[j].values() for cand in cands]
            states[j] = {}
            if beam is not None and len(layer) > beam:
                layer = beam_select(layer, beam)
            if n - j >= 2:
                self.expand_layer(j, layer, states, top)

    def complete_root(self, root: PartialPlan, top: TopPlans) -> None:
        """The one-stage plan: DP over all devices (or the single device)."""
        g = self.cluster.num_devices
        if g > self.rmax or (self.settings.straight_only and g != 1):
            return
        n = self.t.n
        ranks = tuple(range(g))
        s = self.scale(g)
        f, b = self.t.forward[0, n] * s, self.t.backward[0, n] * s
        ar = float(self._exposed_row(self.ring_id(ranks), 0)[n])
        mem = self.t.params[0, n] * self._weight_factors[g] + self.k_of(1) * self.t.stash_bytes(0, n, s)
        if mem > self.cap:
            return
        latency = f + self.m1 * (f + b) + (ar + b)
        top.add(latency, self.m, ((0, n, ranks),))

    def block(self, occupied: frozenset[int], last: tuple[int, ...] | None, sizes: Sequence[int]) -> SuccessorBlock:
        """The ``SuccessorBlock`` of a placement state, holding at least the replica counts
        ``sizes`` (memoised across M)."""
        key = (occupied, last, self.settings.extended)
        found = self.shared.blocks.get(key)
        if found is None:
            found = self.shared.blocks[key] = SuccessorBlock()
        missing = [r for r in sizes if r not in found.by_r]
        if missing:
            for r in missing:
                found.by_r[r] = self._offer(occupied, last, r)
            found.rebuild()
        return found

    def _offer(self, occupied: frozenset[int], last: tuple[int, ...] | None, r: int) -> list[Successor]:
        """The placements for r devices, each with its transfer unit from ``last`` and the
        ring ids of its ranks and of the rest."""
        found = []
        for ranks, taken, rest, ring_ranks, ring_rest in self._options(occupied, last, r):
            succ = Successor(r, ranks, taken, rest, ring_ranks=ring_ranks, ring_rest=ring_rest)
            if last is not None:
                succ.unit_in = self.p2p_unit(last, ranks)[0]
            found.append(succ)
        return found

    def _options(self, occupied: frozenset[int], last: tuple[int, ...] | None, r: int) -> list[tuple]:
        """``placement_options`` for r devices after ``occupied`` as (ranks, ranks then taken,
        the rest, ring ids of the ranks and of the rest). The previous stage's ranks enter
        only through their machines (``append_near`` tries those first), so the memo is
        keyed by them."""
        per = self.per
        near = last if self.settings.extended else None  # the paper's three policies alone without it
        extended = self.settings.extended and self.cluster.num_devices <= EXTENDED_PLACEMENT_DEVICES
        key = (occupied, r, frozenset([device // per for device in near]) if near else None, extended)
        found = self.shared.options.get(key)
        if found is None:
            state = self.shared.states.get(occupied)
            if state is None:  # one per occupied set, so its free ranks per machine are found once for every r
                state = self.shared.states[occupied] = PlacementState(self.cluster, occupied)
            everyone = frozenset(range(self.cluster.num_devices))
            found = []
            for _, ranks in placement_options(state, r, near=near, extended=extended):
                taken = occupied.union(ranks)
                rest = tuple(sorted(everyone.difference(taken)))
                found.append((ranks, taken, rest, self.ring_id(ranks), self.ring_id(rest)))
            self.shared.options[key] = found
        return found

    def expand_layer(self, j: int, layer: Sequence[PartialPlan], states: list[dict[Any, list[PartialPlan]]], top: TopPlans, check_bound: bool = True) -> None:
        """Expand the sub-problems of layer j (all of whose new stages start at j) in order.

        Each sub-problem's successors are every replica count r, every placement the
        policies offer and every end J of the new stage, as (placements x J) arrays. What
        does not depend on the top list's threshold -- the new stage's times, the latency of
        each plan completed with the rest as one stage, the bound of each new sub-problem --
        is priced for the whole layer at once (``_LayerBatch``), for the placements and ends
        allowed at the threshold the layer starts with. Each sub-problem then keeps, in
        turn, what the threshold at its turn allows: a subset, since the threshold only
        falls, and exactly what expanding the sub-problems one by one would have priced.
        """
        thr = top.threshold
        g = self.cluster.num_devices
        parts = []
        for cand in layer:
            if check_bound and cand.lb >= thr:
                continue
            free = g - len(cand.occupied)
            if free < 2:
                continue
            part = self._part(cand, free, thr)
            if part is not None:
                parts.append(part)
        if not parts:
            return
        batch = self._batch(j, parts)
        for part in parts:
            if check_bound and part.cand.lb >= top.threshold:
                continue
            self._finish(batch, part, states, top)

    def _part(self, cand: PartialPlan, free: int, thr: float) -> "_Part | None":
        """One sub-problem's share of a layer: the new stage's replica counts, ends and
        placements (4.2) allowed at threshold ``thr``, with the transfer into it; None when
        nothing is."""
        k = len(cand.stages)  # index of the new stage
        if cand.smax < k + 2:
            return None
        sizes = self._replica_counts(cand, free)
        if not sizes:
            return None
        mask = self._bracket(cand, sizes, free, thr)
        usable = mask.any(axis=1).tolist()
        if True not in usable:
            return None
        wanted = [r for r, ok in zip(sizes, usable) if ok]
        block = self.block(cand.occupied, cand.last, wanted)
        sel = block.select(wanted, sizes)
        j = cand.end
        boundary = float(self.t.cut_bytes(j - 1, self.whole)) if j > 0 else 0.0
        if cand.last is not None and boundary > 0:
            c1 = boundary * sel.unit_in + self.lat
        else:
            c1 = np.zeros(sel.rows.size)
        if self.m1 >= 1:
            keep = self.m1 * np.maximum(cand.max_fb, 2.0 * c1) < thr
            if not keep.all():
                return self._part_of(cand, free, sizes, mask, thr, sel.subset(np.flatnonzero(keep)), c1[keep])
        return self._part_of(cand, free, sizes, mask, thr, sel, c1)

    @staticmethod
    def _part_of(cand: PartialPlan, free: int, sizes: list[int], mask: np.ndarray, thr: float, sel: "_Selection", c1: np.ndarray) -> "_Part | None":
        """The ``_Part`` of the placements ``sel`` (None when there are none)."""
        if sel.rows.size == 0:
            return None
        return _Part(cand, free, sizes, mask, thr, sel.mask_rows, sel.replicas, c1, sel.succs, sel.rest, sel.ring, sel.ring_rest, cand.smax >= len(cand.stages) + 3)

    def _replica_counts(self, cand: PartialPlan, free: int) -> list[int]:
        """Replica counts r of the new stage that leave a valid rest (one stage or more),
        memoised by what they depend on (not to be changed by the caller)."""
        can_extend = cand.smax >= len(cand.stages) + 3
        found = self._sizes.get((free, can_extend))
        if found is None:
            rmax, straight = self.rmax, self.settings.straight_only
            found = self._sizes[(free, can_extend)] = [
                r
                for r in range(1, min(free - 1, rmax) + 1)
                if (not straight or r == 1)
                and ((free - r <= rmax and (not straight or free - r == 1)) or (free - r >= 2 and can_extend))
            ]
        return found

    def _bracket(self, cand: PartialPlan, sizes: list[int], free: int, thr: float) -> np.ndarray:
        """[r, J] mask of the new stage's ends J allowed by parts of the bound: known F+B plus
        the new stage's (grows with J), (M-1) x the new stage's F+B, known F+B plus M x the
        work left per remaining device (shrinks with J)."""
        n, j = self.t.n, cand.end
        if thr == _INF:
            return np.ones((len(sizes), n - 1 - j), dtype=bool)
        fbn_low, rest, steady = self._bracket_terms(j, free, sizes)
        room = thr - cand.sum_fb
        mask = (fbn_low < room) & (rest < room)
        if steady is not None:
            mask &= steady < thr
        return mask

    def _bracket_terms(self, j: int, free: int, sizes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The arrays ``_bracket`` compares with its bars, which depend on the start j, the
        free devices and the replica counts only (memoised: the sub-problems of a layer
        share them): the new stage's F+B, M x the work left per remaining device, and
        (M-1) x the new stage's F+B (None for M = 1)."""
        key = (j, free, tuple(sizes))
        found = self._brackets.get(key)
        if found is None:
            t, n = self.t, self.t.n
            replicas = np.array(sizes)
            s_r = self._scale_array[replicas][:, None]
            per_rest = ((self.m * self.whole) / (free - replicas))[:, None]
            fbn_low = t.work[j, j + 1 : n][None, :] * s_r
            steady = self.m1 * fbn_low if self.m1 >= 1 else None
            found = self._brackets[key] = (fbn_low, t.work[j + 1 : n, n][None, :] * per_rest, steady)
        return found

    def _batch(self, j: int, parts: list["_Part"]) -> "_LayerBatch":
        """The layer's placements (rows, the parts' one after another) and ends (columns):
        the new stage's times, ``t_max``, the completed plans' latencies (inf where a plan is
        invalid) and the bounds of the new sub-problems."""
        t = self.t
        inside_all = np.concatenate([part.mask[part.mask_rows] for part in parts])
        columns = np.flatnonzero(inside_all.any(axis=0))
        c0, c_hi = int(columns[0]), int(columns[-1])
        lo, hi = j + 1 + c0, j + 2 + c_hi  # ends J in [lo, hi)
        start = 0
        for part in parts:
            part.start, start = start, start + part.replicas.size
            part.stop = start
        cat = np.concatenate
        replicas, rest, c1 = cat([p.replicas for p in parts]), cat([p.rest for p in parts]), cat([p.c1 for p in parts])
        owner = np.repeat(np.arange(len(parts)), [p.replicas.size for p in parts])
        per_cand = np.array([(p.cand.pf, p.cand.tail, p.cand.max_fb, p.cand.sum_fb) for p in parts])[owner]
        s_r = self._scale_array[replicas][:, None]
        fn = t.forward[j, lo:hi][None, :] * s_r
        bn = t.backward[j, lo:hi][None, :] * s_r
        batch = _LayerBatch(
            j=j, lo=lo, hi=hi, c0=c0, ends=np.arange(lo, hi), inside=inside_all[:, c0 : c_hi + 1],
            succs=[succ for part in parts for succ in part.succs], c1=c1, c1_list=c1.tolist(), rest=rest, per_cand=per_cand,
            fn=fn, bn=bn, fbn=fn + bn, an=self._exposed_rows(cat([p.ring for p in parts]), j, lo, hi), tmax=self.tmax_rows(j, replicas, lo, hi),
        )
        batch.s_rest = np.where(rest <= self.rmax, self._scale_array[rest], 0.0)[:, None]
        self._batch_complete(batch, parts, cat([p.ring_rest for p in parts]))
        if not self.shallow:
            self._batch_extend(batch, parts, owner)
        return batch

    def _batch_complete(self, batch: "_LayerBatch", parts: list["_Part"], ring_rest: np.ndarray) -> None:
        """``batch.latency``: prefix + new stage [j, J) + the rest as one stage (formula 2),
        inf where that plan is invalid; ``batch.valid``: where it is valid."""
        t, n = self.t, self.t.n
        complete_ok = batch.rest <= self.rmax
        if self.settings.straight_only:
            complete_ok &= batch.rest == 1
        weights = t.params[batch.lo : batch.hi, n][None, :] * self._weight_factors[batch.rest][:, None]
        mem = weights + self.k_of(1) * t.stash_bytes(slice(batch.lo, batch.hi), n, batch.s_rest)
        batch.valid = batch.inside & complete_ok[:, None] & (batch.tmax >= 2) & (mem <= self.cap)
        batch.latency = np.full(batch.fn.shape, _INF)
        if batch.valid.any():
            batch.latency[batch.valid] = self._complete_cells(batch, parts, ring_rest)

    def _batch_extend(self, batch: "_LayerBatch", parts: list["_Part"], owner: np.ndarray) -> None:
        """``batch.extend``: where a successor may stay a sub-problem (memory for the stages
        after it, layers left to split); ``batch.lb``: its bound (``lower_bound``)."""
        t, n = self.t, self.t.n
        extend_ok = np.array([p.can_extend for p in parts])[owner] & (batch.rest >= 2)
        batch.extend = extend_ok[:, None] & (batch.tmax >= 3) & (batch.ends <= n - 2)[None, :]
        remaining = t.work[batch.lo : batch.hi, n][None, :] * (self.whole / batch.rest.astype(float)[:, None])
        fb1 = 2.0 * batch.c1[:, None]
        max_fb = np.maximum(np.maximum(batch.per_cand[:, 2:3], fb1), batch.fbn)
        sum_fb = batch.per_cand[:, 3:4] + fb1 + batch.fbn
        batch.lb = self.bound(max_fb, sum_fb, remaining)

    def _finish(self, batch: "_LayerBatch", part: "_Part", states: list[dict[Any, list[PartialPlan]]], top: TopPlans) -> None:
        """One sub-problem's turn: the placements and ends the threshold now allows, the
        completed plans that enter the top list, and the successors that stay sub-problems."""
        cand, thr = part.cand, top.threshold
        if thr == part.thr:  # all of the part's rows, as a slice (views, not copies)
            rows: Any = slice(part.start, part.stop)
            inside = batch.inside[rows]
        else:
            mask = self._bracket(cand, part.sizes, part.free, thr)
            keep = mask.any(axis=1)[part.mask_rows]
            if self.m1 >= 1:
                keep &= self.m1 * np.maximum(cand.max_fb, 2.0 * part.c1) < thr
            if not keep.any():
                return
            rows = part.start + np.flatnonzero(keep)
            inside = mask[part.mask_rows[keep], batch.c0 : batch.c0 + batch.ends.size]
        hit_rows, hit_cols = np.nonzero(inside & (batch.latency[rows] < thr))
        if hit_rows.size:
            n, j = self.t.n, batch.j
            at = self._rows_at(rows, hit_rows)
            for row, end, value in zip(at.tolist(), batch.ends[hit_cols].tolist(), batch.latency.take(at * batch.ends.size + hit_cols).tolist()):
                succ = batch.succs[row]
                top.add(value, self.m, cand.stages + ((j, end, succ.ranks), (end, n, succ.rest)))
        if not self.shallow:
            self._admit(batch, cand, rows, inside, states, top)

    @staticmethod
    def _rows_at(rows: "slice | np.ndarray", picked: np.ndarray) -> np.ndarray:
        """The batch rows at positions ``picked`` of ``rows`` (a slice of rows or an array)."""
        return picked + rows.start if isinstance(rows, slice) else rows[picked]

    def _admit(self, batch: "_LayerBatch", cand: PartialPlan, rows: "slice | np.ndarray", inside: np.ndarray, states: list[dict[Any, list[PartialPlan]]], top: TopPlans) -> None:
        """Admit the successors that stay sub-problems (the layers after J still to split)."""
        ok = inside & batch.extend[rows]
        if not ok.any():
            return
        lb = batch.lb[rows]
        ok &= lb < top.threshold
        beam = self.settings.beam is not None
        if beam:
            ok &= lb < self._cut[batch.lo : batch.hi][None, :]
        sub_rows, columns = np.nonzero(ok)
        if sub_rows.size == 0:
            return
        at = self._rows_at(rows, sub_rows)
        ends = batch.ends[columns].tolist()
        # the admitted successors' numbers as Python floats, gathered at once (by flat index);
        # the rest of their features is derived from them when (if) they become sub-problems
        flat = at * batch.ends.size + columns
        gathered = [array.take(flat).tolist() for array in (batch.fn, batch.bn, batch.an, batch.tmax, batch.lb, batch.latency)]
        if beam:
            self._push_pending(batch, cand, at.tolist(), ends, gathered)
            return
        succs, c1, start = batch.succs, batch.c1_list, batch.j
        for row, end, fn, bn, an, tmax, value, tpl in zip(at.tolist(), ends, *gathered):
            self._insert_pending(Pending(cand, start, end, succs[row], c1[row], fn, bn, an, tmax, value, tpl), states)

    def _push_pending(self, batch: "_LayerBatch", cand: PartialPlan, rows: list[int], ends: list[int], gathered: list[list[float]]) -> None:
        """With a beam: keep each successor in its end's heap of the ``beam_insert`` lowest
        bounds, and ``_cut`` (the bound a successor must stay under once a heap is full)
        up to date."""
        width, pending, cut = self.settings.beam_insert, self._pending, self._cut
        succs, c1, start = batch.succs, batch.c1_list, batch.j
        for row, end, fn, bn, an, tmax, value, tpl in zip(rows, ends, *gathered):
            heap = pending[end]
            if len(heap) < width:
                self._seq += 1
                heapq.heappush(heap, (-value, self._seq, Pending(cand, start, end, succs[row], c1[row], fn, bn, an, tmax, value, tpl)))
            elif value < -heap[0][0]:
                self._seq += 1
                heapq.heapreplace(heap, (-value, self._seq, Pending(cand, start, end, succs[row], c1[row], fn, bn, an, tmax, value, tpl)))
            else:
                continue
            if len(heap) >= width:
                cut[end] = -heap[0][0]

    def _insert_pending(self, pending: "Pending", states: list[dict[Any, list[PartialPlan]]]) -> None:
        """Insert a successor into its sub-problem unless it ranks behind every kept one."""
        succ = pending.successor
        if succ.key is None:
            succ.key = self.key(succ.occupied, succ.ranks)
        bucket = states[pending.end].get(succ.key)
        if bucket is not None and len(bucket) >= self.settings.keep_per_state:
            worst = bucket[-1]
            # ranks behind every kept candidate and cannot dominate the worst of them
            if pending.tpl > worst.tpl and max(max(pending.cand.max_fb, 2.0 * pending.c1), pending.fn + pending.bn) > worst.max_fb:
                return
        self.insert(states[pending.end], *self._materialise(pending))

    def _materialise(self, pending: "Pending") -> tuple[Any, PartialPlan]:
        """A successor as (sub-problem key, candidate): the features of ``PartialPlan``
        from the new stage's numbers (the same operations, in the same order, as the
        bound in ``_batch_extend``)."""
        cand, succ, c = pending.cand, pending.successor, pending.c1
        if succ.key is None:
            succ.key = self.key(succ.occupied, succ.ranks)
        fn, bn, an, m1 = pending.fn, pending.bn, pending.an, self.m1
        fb1, fbn = 2.0 * c, fn + bn
        new = PartialPlan(
            stages=cand.stages + ((pending.start, pending.end, succ.ranks),),
            phases=cand.phases + (((c, c, 0.0),) if c > 0 else ()) + ((fn, bn, an),),
            occupied=succ.occupied,
            end=pending.end,
            pf=cand.pf + c + fn,
            tail=max(max(cand.tail + c + bn, c + bn), an + bn),
            claim=max(max(cand.claim - fb1 - fbn, m1 * fb1 - fbn), m1 * fbn),
            max_fb=max(max(cand.max_fb, fb1), fbn),
            sum_fb=cand.sum_fb + fb1 + fbn,
            smax=min(cand.smax, len(cand.stages) + pending.tmax),
            lb=pending.lb,
            tpl=pending.tpl,
        )
        return succ.key, new

    def ring_key(self, ranks: tuple[int, ...]) -> tuple[int, float]:
        """What the exposed AllReduce tail of a stage on ``ranks`` depends on: the replica
        count and the ring's ms per byte (0 for one replica)."""
        coef, bpm = self.ring(ranks)
        return len(ranks), (coef / bpm if len(ranks) > 1 else 0.0)

    def ring_id(self, ranks: tuple[int, ...]) -> int:
        """``SharedMemo.ring_id`` of ``ring_key(ranks)``, memoised by what the key depends
        on: the replica count and whether the ranks span machines (``ring_bandwidth_gbps``)."""
        per = self.per
        shape = (len(ranks), min(ranks) // per != max(ranks) // per)
        found = self.shared.ring_of_shape.get(shape)
        if found is None:
            found = self.shared.ring_of_shape[shape] = self.shared.ring_id(self.ring_key(ranks))
        return found

    def _exposed_by_key(self, key: tuple[int, float]) -> np.ndarray:
        """Exposed AllReduce tail of every layer range [j, J) replicated on a ring with
        ``ring_key`` ``key`` (``OverlapTables.tail``; ``costs.exposed_tail`` for one stage)."""
        found = self._exposed.get(key)
        if found is None:
            replicas, per_byte = key
            found = self._exposed[key] = self.t.tail(per_byte, self.ring_lat(replicas), self.scale(replicas), replicas, self.settings.zero)
        return found

    def _exposed_table(self, ring: int) -> np.ndarray:
        """``_exposed_by_key`` by ring id."""
        found = self._exposed_ids.get(ring)
        if found is None:
            found = self._exposed_ids[ring] = self._exposed_by_key(self.shared.ring_keys[ring])
        return found

    def _exposed_row(self, ring: int, j: int) -> np.ndarray:
        """Row j of ``_exposed_table(ring)``. The first layer's row is priced without the
        table while the table is not there (``OverlapTables.tail_row``, equal element for
        element): the probe of every M (``run(shallow=True)``) asks for no other row, and
        many of its rings are not used again."""
        found = self._exposed_ids.get(ring)
        if found is not None:
            return found[j]
        if j != 0:
            return self._exposed_table(ring)[j]
        row = self._exposed_first.get(ring)
        if row is None:
            replicas, per_byte = self.shared.ring_keys[ring]
            row = self._exposed_first[ring] = self.t.tail_row(per_byte, self.ring_lat(replicas), self.scale(replicas), 0, replicas, self.settings.zero)
        return row

    def _exposed_rows(self, rings: np.ndarray, j: int, lo: int, hi: int) -> np.ndarray:
        """Exposed tails of [j, J) for J in [lo, hi), one row per ring id (each distinct
        ring's row fetched once)."""
        distinct, inverse = _distinct(rings)
        return np.array([self._exposed_row(ring, j)[lo:hi] for ring in distinct.tolist()])[inverse]

    def _exposed_last(self, rings: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Exposed tails of [J, n) for the ring ids ``rings`` and ends ``ends`` (elementwise;
        a per-ring column of the tables kept as one array)."""
        top = int(rings.max())
        if top >= self._last_have.size:
            size = max(top + 1, 2 * self._last_have.size)
            grown = np.zeros((size, self.t.n + 1))
            grown[: self._last.shape[0]] = self._last
            have = np.zeros(size, dtype=bool)
            have[: self._last_have.size] = self._last_have
            self._last, self._last_have = grown, have
        missing = rings[~self._last_have[rings]]
        for ring in set(missing.tolist()):
            self._last[ring] = self._exposed_column(ring)
            self._last_have[ring] = True
        return self._last[rings, ends]

    def _exposed_column(self, ring: int) -> np.ndarray:
        """The last column of ``_exposed_table(ring)`` (ranges [J, n)), without the table when
        it is not there yet (``OverlapTables.tail_column``, equal element for element)."""
        found = self._exposed_ids.get(ring)
        if found is not None:
            return found[:, self.t.n]
        replicas, per_byte = self.shared.ring_keys[ring]
        return self.t.tail_column(per_byte, self.ring_lat(replicas), self.scale(replicas), self.t.n, replicas, self.settings.zero)

    def rest_unit(self, succ: Successor) -> float:
        """``p2p_unit`` from a successor's ranks to the rest, looked up once per successor."""
        unit = succ.unit_rest
        if unit is None:
            unit = succ.unit_rest = self.p2p_unit(succ.ranks, succ.rest)[0]
        return unit

    def _complete_cells(self, batch: "_LayerBatch", parts: list["_Part"], ring_rest: np.ndarray) -> np.ndarray:
        """Formula 2 for every valid cell of ``batch`` (row-major order): the prefix's phases
        and the new ones (transfer c1, stage n, transfer c2, rest R), with Algorithm 1's
        pivot found incrementally: among the new phases directly, inside the prefix through
        its pivot records (``PartialPlan.records``)."""
        t, n, m1 = self.t, self.t.n, self.m1
        rows, columns = np.nonzero(batch.valid)
        ends = columns + batch.lo
        needed = np.zeros(len(batch.succs), dtype=bool)
        needed[rows] = True
        units = np.zeros(len(batch.succs))
        at = np.flatnonzero(needed)
        units[at] = [self.rest_unit(succ) for succ in map(batch.succs.__getitem__, at.tolist())]
        fn, bn, an, fbn = batch.fn[rows, columns], batch.bn[rows, columns], batch.an[rows, columns], batch.fbn[rows, columns]
        c1, s_rest = batch.c1[rows], batch.s_rest[rows, 0]
        fr, br = t.forward[ends, n] * s_rest, t.backward[ends, n] * s_rest
        ar = self._exposed_last(ring_rest[rows], ends)
        out = t.cut_bytes(ends - 1, self.whole)
        c2 = np.where(out > 0, out * units[rows] + self.lat, 0.0)
        fb1, fb2, fbr = 2.0 * c1, 2.0 * c2, fr + br
        # Algorithm 1 over the new phases (R, c2, n, c1); a = F+B after the phase being
        # checked up to and including the pivot (costs.walk_pivot)
        v = m1 * fbr
        a = fbr
        q = np.full(v.shape, 3)
        for code, own_fb in ((2, fb2), (1, fbn), (0, fb1)):
            l1 = m1 * own_fb
            move = l1 > v + a
            v = np.where(move, l1, v)
            a = np.where(move, own_fb, a + own_fb)
            q = np.where(move, code, q)
        latency = self._pivot_latency(q, v, batch.per_cand[rows, 0], batch.per_cand[rows, 1], (fn, bn, an, c1, fr, br, ar, c2))
        # pivots inside a prefix: each part's cells are one run of the row-major order
        bounds = np.searchsorted(rows, [part.start for part in parts] + [len(batch.succs)])
        va = v + a
        for index, part in enumerate(parts):
            if part.cand.stages and bounds[index] < bounds[index + 1]:
                cells = slice(bounds[index], bounds[index + 1])
                b1, bn_, an_ = c1[cells], bn[cells], an[cells]
                ar_, b2, br_ = ar[cells], c2[cells], br[cells]
                rec_h, rec_ws, rec_e, rec_bq = part.cand.record_arrays(m1)
                idx = np.searchsorted(rec_h, va[cells], side="right")
                inner = idx < rec_h.size
                if inner.any():
                    ii = np.minimum(idx, rec_h.size - 1)
                    bq = rec_bq[ii]
                    end_in = np.maximum(np.maximum(rec_e[ii], an_ - bq - b1 - bn_), ar_ - bq - b1 - bn_ - b2 - br_)
                    latency[cells] = np.where(inner, rec_ws[ii] + end_in, latency[cells])
        return latency

    @staticmethod
    def _pivot_latency(q: np.ndarray, v: np.ndarray, pf: np.ndarray, tail: np.ndarray, phases: tuple[np.ndarray, ...]) -> np.ndarray:
        """Warm-up + steady (``v``) + ending phase for a pivot ``q`` among the new phases
        (0: c1, 1: stage n, 2: c2, 3: R); the prefix enters through its forward sum ``pf``
        and its tail (costs.ending_phase), the sums shared where they are accumulated in
        the same order. Only the pivot positions that occur are priced."""
        fn, bn, an, c1, fr, br, ar, c2 = phases
        b1, b2 = c1, c2
        present = np.bincount(q, minlength=4) > 0
        w0 = pf + c1
        w1 = w0 + fn
        e1 = tail + b1
        e2 = e1 + bn
        u1 = an + bn
        latency = None
        if present[2] or present[3]:
            w2 = w1 + c2
            e3 = e2 + b2
            u2 = u1 + b2
            if present[3]:
                end3 = np.maximum(np.maximum(e3 + br, u2 + br), np.maximum(b2 + br, ar + br))
                latency = w2 + fr + v + end3
            if present[2]:
                end2 = np.maximum(np.maximum(e3, u2), np.maximum(b2, ar - br))
                own = w2 + v + end2
                latency = own if latency is None else np.where(q == 2, own, latency)
        if present[1]:
            end1 = np.maximum(np.maximum(e2, u1), np.maximum(-b2, ar - b2 - br))
            own = w1 + v + end1
            latency = own if latency is None else np.where(q == 1, own, latency)
        if present[0]:
            end0 = np.maximum(np.maximum(e1, an - bn), np.maximum(-bn - b2, ar - bn - b2 - br))
            own = w0 + v + end0
            latency = own if latency is None else np.where(q == 0, own, latency)
        return latency

    def insert(self, bucket: dict[Any, list[PartialPlan]], key: Any, new: PartialPlan) -> None:
        """Keep the ``keep_per_state`` best (``rank``) non-dominated candidates, sorted."""
        cands = bucket.get(key)
        if cands is None:
            bucket[key] = [new]
            return
        for old in cands:
            if dominates(old, new):
                return
        kept = [old for old in cands if not dominates(new, old)]
        kept.append(new)
        kept.sort(key=rank)
        del kept[self.settings.keep_per_state :]
        bucket[key] = kept


def _distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` for small non-negative integers (replica
    counts, ring ids), by counting instead of sorting."""
    present = np.bincount(values)
    distinct = np.flatnonzero(present)
    position = np.zeros(present.size, dtype=np.intp)
    position[distinct] = np.arange(distinct.size)
    return distinct, position[values]


class _Part:
    """One sub-problem's share of a layer batch: its new stage's replica counts (``sizes``)
    and their bracket ``mask`` at threshold ``thr``, and its placements (rows ``start`` to
    ``stop`` of the batch) with the transfer into each (``c1``)."""

    __slots__ = ("cand", "free", "sizes", "mask", "thr", "mask_rows", "replicas", "c1", "succs", "rest", "ring", "ring_rest", "can_extend", "start", "stop")

    def __init__(self, cand: PartialPlan, free: int, sizes: list[int], mask: np.ndarray, thr: float, mask_rows: np.ndarray, replicas: np.ndarray, c1: np.ndarray,
                 succs: list[Successor], rest: np.ndarray, ring: np.ndarray, ring_rest: np.ndarray, can_extend: bool) -> None:
        self.cand, self.free, self.sizes, self.mask, self.thr, self.mask_rows = cand, free, sizes, mask, thr, mask_rows
        self.replicas, self.c1, self.succs, self.rest, self.ring, self.ring_rest = replicas, c1, succs, rest, ring, ring_rest
        self.can_extend = can_extend
        self.start = self.stop = 0


class _LayerBatch:
    """The placements (rows) and new-stage ends (columns, J in [lo, hi)) of every sub-problem
    of one layer j: ``inside`` (the bracket), the new stage's F, B and exposed AllReduce,
    its ``t_max``, the completed plans' ``latency`` (inf where not ``valid``), and where a
    successor may stay a sub-problem (``extend``) with its bound ``lb``."""

    __slots__ = ("j", "lo", "hi", "c0", "ends", "inside", "succs", "c1", "c1_list", "rest", "per_cand", "fn", "bn", "fbn", "an", "tmax", "s_rest", "valid", "latency", "extend", "lb")

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)


class Pending(NamedTuple):
    """A successor before it becomes a ``PartialPlan``: its parent, the new stage [start,
    end) on the successor's ranks, the transfer into it, the new stage's F, B and exposed
    AllReduce, its ``t_max``, the bound and T_PL."""

    cand: PartialPlan
    start: int
    end: int
    successor: Successor
    c1: float
    fn: float
    bn: float
    an: float
    tmax: float
    lb: float
    tpl: float
