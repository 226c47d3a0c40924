"""One run of DAPPLE's dynamic programme (4.3, formulas 4-5) for a fixed M.

See ``dapple_planner`` for the search as a whole. A sub-problem has planned the first j
layers as complete stages (a ``PartialPlan``); ``expand`` prices, with arrays, every next
stage at once -- every replica count r, every placement the policies of 4.2 offer and
every end J -- both as the plan's last-but-one stage with the rest as one final stage
(``complete_rows``: the paper's T_PL, formula 2 computed incrementally) and as a new
sub-problem to split further.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import slice_size
from lightning_dapple.plan.partial import PartialPlan, Placement, RawStages, TopPlans, beam_select, dominates, rank
from lightning_dapple.plan.placement import PlacementState, placement_options
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

    @property
    def beam_insert(self) -> int:
        """Sub-problems admitted per layer when a beam is set (more than are expanded)."""
        return 4 * (self.beam or 0)


@dataclass
class Successor:
    """One placement of a next stage: its ranks, what is left, and the new state's key."""

    r: int
    ranks: tuple[int, ...]
    occupied: frozenset[int]
    rest: tuple[int, ...]
    key: Any = None  # filled when first needed
    unit_in: float | None = None  # p2p unit from the previous stage's ranks, when first needed
    unit_rest: float | None = None  # p2p unit from these ranks to the rest, when first needed
    ring_ranks: tuple[int, float] | None = None  # ``StageSearch.ring_key`` of the ranks
    ring_rest: tuple[int, float] | None = None  # ... and of the rest



class SharedMemo:
    """Memo tables that do not depend on M: placements offered per placement state."""

    def __init__(self) -> None:
        self.successors: dict[tuple, list[Successor]] = {}
        self.p2p: dict[tuple, tuple[float, float]] = {}
        self.rings: dict[tuple[int, ...], tuple[float, float]] = {}


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
        self.weight_factor = 2.0 + cluster.optimizer_state_factor
        self.lat = cluster.latency_ms
        self.per = cluster.devices_per_machine
        self._scales = [0.0] + [slice_size(self.mbs, r) / tables.pbs for r in range(1, cluster.num_devices + 1)]
        self._exposed: dict[tuple[int, float], np.ndarray] = {}
        self._tmax: dict[int, np.ndarray] = {}

    # -- cost helpers (the formulas of costs.py / cluster.py, vectorised) --------------

    def scale(self, replicas: int) -> float:
        """A replica's slice of a micro-batch, in profile batches (memoised)."""
        return self._scales[replicas]

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

    def tmax_table(self, j: int) -> np.ndarray:
        """``t_max`` of every stage [j, J) (columns J) for every replica count (rows),
        computed once per start j."""
        found = self._tmax.get(j)
        if found is None:
            scales = np.array(self._scales)[:, None]
            t = self.t
            found = self._tmax[j] = self.t_max(t.params[j][None, :] * self.weight_factor, t.stash[j][None, :] * scales)
        return found

    def p2p_unit(self, senders: tuple[int, ...], receivers: tuple[int, ...]) -> tuple[float, float]:
        """``p2p_ms`` is ``bytes * unit + latency`` for any positive byte count (memoised
        across M; equal to ``p2p_ms`` up to rounding, and plans are re-priced exactly)."""
        # the search's senders and receivers are disjoint (a stage's ranks are free when it
        # is placed), so p2p_ms depends only on their machines in order: every split-concat
        # piece's route and each sender's and receiver's byte sums are the same
        per = self.per
        key = (tuple([rank // per for rank in senders]), tuple([rank // per for rank in receivers]))
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
                self.expand(root, g, [dict() for _ in range(n + 1)], top)
            return
        states: list[dict[Any, list[PartialPlan]]] = [dict() for _ in range(n + 1)]
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
                layer = beam_select(layer, beam)
            for cand in layer:
                if cand.lb >= top.threshold:
                    continue
                free = g - len(cand.occupied)
                if free < 2 or n - j < 2:
                    continue
                self.expand(cand, free, states, top)

    def complete_root(self, root: PartialPlan, top: TopPlans) -> None:
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

    def successors(self, occupied: frozenset[int], last: tuple[int, ...] | None, r: int) -> list[Successor]:
        """The placements the policies offer for r devices after ``occupied`` (DAPPLE 4.2),
        memoised across M."""
        key = (occupied, last, r, self.settings.extended)
        found = self.shared.successors.get(key)
        if found is None:
            state = PlacementState(self.cluster, occupied)
            found = []
            everyone = frozenset(range(self.cluster.num_devices))
            extended = self.settings.extended and self.cluster.num_devices <= EXTENDED_PLACEMENT_DEVICES
            near = last if self.settings.extended else None  # the paper's three policies alone without it
            for _, ranks in placement_options(state, r, near=near, extended=extended):
                taken = occupied.union(ranks)
                rest = tuple(sorted(everyone.difference(taken)))
                found.append(Successor(r, ranks, taken, rest))
            self.shared.successors[key] = found
        return found

    def expand(self, cand: PartialPlan, free: int, states: list[dict[Any, list[PartialPlan]]], top: TopPlans) -> None:
        """All successors of one sub-problem at once: every replica count r, every placement
        the policies offer and every end J of the new stage, as (placements x J) arrays."""
        k = len(cand.stages)  # index of the new stage
        if cand.smax < k + 2:
            return
        sizes = self._replica_counts(cand, free)
        if not sizes:
            return
        mask = self._bracket(cand, sizes, free, top.threshold)
        usable = {r: index for index, r in enumerate(sizes) if mask[index].any()}
        if not usable:
            return
        placements, rows = self._placements(cand, usable, free, top.threshold)
        if not placements:
            return
        stage = self._new_stage(cand, placements, mask[rows])
        tpl = np.full(stage.fn.shape, _INF)
        if stage.complete_ok.any() and cand.smax >= k + 2:
            tpl = self.complete_rows(cand, stage, top)
        self._extend(cand, stage, tpl, states, top)

    def _replica_counts(self, cand: PartialPlan, free: int) -> list[int]:
        """Replica counts r of the new stage that leave a valid rest (one stage or more)."""
        k, rmax, straight = len(cand.stages), self.rmax, self.settings.straight_only
        can_extend = cand.smax >= k + 3
        return [
            r
            for r in range(1, min(free - 1, rmax) + 1)
            if (not straight or r == 1)
            and ((free - r <= rmax and (not straight or free - r == 1)) or (free - r >= 2 and can_extend))
        ]

    def _bracket(self, cand: PartialPlan, sizes: list[int], free: int, thr: float) -> np.ndarray:
        """[r, J] mask of the new stage's ends J allowed by parts of the bound: known F+B plus
        the new stage's (grows with J), (M-1) x the new stage's F+B, known F+B plus M x the
        work left per remaining device (shrinks with J)."""
        t, n, j = self.t, self.t.n, cand.end
        if thr == _INF:
            return np.ones((len(sizes), n - 1 - j), dtype=bool)
        s_r = np.array([self.scale(r) for r in sizes])[:, None]
        per_rest = np.array([self.m * self.whole / (free - r) for r in sizes])[:, None]
        room = thr - cand.sum_fb
        fbn_low = t.work[j, j + 1 : n][None, :] * s_r
        mask = (fbn_low < room) & (t.work[j + 1 : n, n][None, :] * per_rest < room)
        if self.m1 >= 1:
            mask &= self.m1 * fbn_low < thr
        return mask

    def _placements(self, cand: PartialPlan, usable: dict[int, int], free: int, thr: float) -> tuple[list[Placement], list[int]]:
        """Every placement of the new stage the policies offer (4.2), with its transfer time,
        and for each the row of its replica count in the bracket mask."""
        j, last, k = cand.end, cand.last, len(cand.stages)
        boundary = self.t.output[j - 1] * self.whole if j > 0 else 0.0
        straight, rmax = self.settings.straight_only, self.rmax
        can_extend = cand.smax >= k + 3
        placements, rows = [], []
        for r, index in usable.items():
            for succ in self.successors(cand.occupied, last, r):
                if last is not None and boundary > 0:
                    unit = succ.unit_in
                    if unit is None:
                        unit = succ.unit_in = self.p2p_unit(last, succ.ranks)[0]
                    c1 = boundary * unit + self.lat
                else:
                    c1 = 0.0
                if self.m1 >= 1 and self.m1 * max(cand.max_fb, 2.0 * c1) >= thr:
                    continue
                rest = free - succ.r
                complete_ok = rest <= rmax and (not straight or rest == 1)
                placements.append(Placement(succ.r, succ.ranks, succ.rest, succ.occupied, c1, succ, complete_ok, rest >= 2 and can_extend))
                rows.append(index)
        return placements, rows

    def _new_stage(self, cand: PartialPlan, placements: list[Placement], inside_all: np.ndarray) -> "NewStage":
        """The new stage [j, J) for every placement (rows) and end J (columns)."""
        t, j = self.t, cand.end
        columns = np.nonzero(inside_all.any(axis=0))[0]
        lo0, hi0 = j + 1 + int(columns[0]), j + 1 + int(columns[-1])
        col = lambda values: np.array(values, dtype=float)[:, None]  # noqa: E731
        s_r = col([self.scale(p.replicas) for p in placements])
        ends = slice(lo0, hi0 + 1)
        replicas = np.array([p.replicas for p in placements])
        return NewStage(
            placements=placements,
            ends=np.arange(lo0, hi0 + 1),
            inside=inside_all[:, columns[0] : columns[-1] + 1],
            fn=t.forward[j, ends][None, :] * s_r,
            bn=t.backward[j, ends][None, :] * s_r,
            an=np.stack([self.exposed_of(p.successor, False)[j, ends] for p in placements]),
            tmax=self.tmax_table(j)[replicas, lo0 : hi0 + 1],
            c1=col([p.transfer_ms for p in placements]),
            s_rest=col([self.scale(len(p.rest)) if len(p.rest) <= self.rmax else 0.0 for p in placements]),
            complete_ok=np.array([p.complete_ok for p in placements])[:, None],
            extend_ok=np.array([p.extend_ok for p in placements])[:, None],
        )

    def _extend(self, cand: PartialPlan, stage: "NewStage", tpl: np.ndarray, states: list[dict[Any, list[PartialPlan]]], top: TopPlans) -> None:
        """Admit the successors that stay sub-problems (the layers after J still to split)."""
        t, n, m1, k = self.t, self.t.n, self.m1, len(cand.stages)
        J, fn, bn = stage.ends, stage.fn, stage.bn
        rests = np.array([len(p.rest) for p in stage.placements], dtype=float)[:, None]
        remaining = t.work[int(J[0]) : int(J[-1]) + 1, n][None, :] * (self.whole / rests)
        fb1, fbn = 2.0 * stage.c1, fn + bn
        max_fb = np.maximum(np.maximum(cand.max_fb, fb1), fbn)
        sum_fb = cand.sum_fb + fb1 + fbn
        lb = self.bound(max_fb, sum_fb, remaining)
        ok = stage.inside & stage.extend_ok & (stage.tmax >= 3) & (J[None, :] <= n - 2) & (lb < top.threshold)
        if self.shallow or not ok.any():
            return
        if self.settings.beam is not None:
            width = self.settings.beam_insert
            cut = np.array([-self._pending[jj][0][0] if len(self._pending[jj]) >= width else _INF for jj in J.tolist()])
            ok &= lb < cut[None, :]
            if not ok.any():
                return
        features = Features(
            fn=fn, bn=bn, an=stage.an, pf=cand.pf + stage.c1 + fn,
            tail=np.maximum(np.maximum(cand.tail + stage.c1 + bn, stage.c1 + bn), stage.an + bn),
            claim=np.maximum(np.maximum(cand.claim - fb1 - fbn, m1 * fb1 - fbn), m1 * fbn),
            max_fb=max_fb, sum_fb=sum_fb, smax=np.minimum(cand.smax, k + stage.tmax), lb=lb, tpl=tpl,
        )
        beam = self.settings.beam is not None
        width = self.settings.beam_insert
        rows, columns = np.nonzero(ok)
        # every admitted successor's features as Python floats, gathered at once
        shape = ok.shape
        values = [(array if array.shape == shape else np.broadcast_to(array, shape))[rows, columns].tolist() for array in features]
        lbs = values[Features._fields.index("lb")]
        for index, (p, end) in enumerate(zip(rows.tolist(), J[columns].tolist())):
            heap = self._pending[end] if beam else None
            if beam and len(heap) >= width and lbs[index] >= -heap[0][0]:
                continue  # the layer's heap holds lower bounds only
            at = Features(*[column[index] for column in values])
            pending = Pending(cand, cand.end, end, stage.placements[p], at)
            if beam:
                self._push(pending)
            else:
                self._insert_pending(pending, states)

    def _push(self, pending: "Pending") -> None:
        """A successor waits in its layer's bounded heap (lowest bounds) under a beam."""
        heap = self._pending[pending.end]
        value = pending.features.lb
        width = self.settings.beam_insert
        if len(heap) >= width and value >= -heap[0][0]:
            return
        self._seq += 1
        if len(heap) < width:
            heapq.heappush(heap, (-value, self._seq, pending))
        else:
            heapq.heapreplace(heap, (-value, self._seq, pending))

    def _insert_pending(self, pending: "Pending", states: list[dict[Any, list[PartialPlan]]]) -> None:
        """Insert a successor into its sub-problem unless it ranks behind every kept one."""
        succ = pending.placement.successor
        if succ.key is None:
            succ.key = self.key(succ.occupied, succ.ranks)
        bucket = states[pending.end].get(succ.key)
        f = pending.features
        if bucket is not None and len(bucket) >= self.settings.keep_per_state:
            worst = bucket[-1]
            # ranks behind every kept candidate and cannot dominate the worst of them
            if f.tpl > worst.tpl and f.max_fb > worst.max_fb:
                return
        self.insert(states[pending.end], *self._materialise(pending))

    def _materialise(self, pending: "Pending") -> tuple[Any, PartialPlan]:
        """A successor as (sub-problem key, candidate)."""
        cand, placement, f = pending.cand, pending.placement, pending.features
        succ = placement.successor
        if succ.key is None:
            succ.key = self.key(succ.occupied, succ.ranks)
        c = placement.transfer_ms
        new = PartialPlan(
            stages=cand.stages + ((pending.start, pending.end, placement.ranks),),
            phases=cand.phases + (((c, c, 0.0),) if c > 0 else ()) + ((f.fn, f.bn, f.an),),
            occupied=placement.occupied,
            end=pending.end,
            pf=f.pf,
            tail=f.tail,
            claim=f.claim,
            max_fb=f.max_fb,
            sum_fb=f.sum_fb,
            smax=f.smax,
            lb=f.lb,
            tpl=f.tpl,
        )
        return succ.key, new

    def ring_key(self, ranks: tuple[int, ...]) -> tuple[int, float]:
        """What the exposed AllReduce tail of a stage on ``ranks`` depends on: the replica
        count and the ring's ms per byte (0 for one replica)."""
        coef, bpm = self.ring(ranks)
        return len(ranks), (coef / bpm if len(ranks) > 1 else 0.0)

    def exposed(self, ranks: tuple[int, ...]) -> np.ndarray:
        """Exposed AllReduce tail of every layer range [j, J) replicated on ``ranks``
        (``OverlapTables.tail``; ``costs.exposed_tail`` for one stage)."""
        return self._exposed_by_key(self.ring_key(ranks))

    def _exposed_by_key(self, key: tuple[int, float]) -> np.ndarray:
        found = self._exposed.get(key)
        if found is None:
            replicas, per_byte = key
            found = self._exposed[key] = self.t.overlap.tail(per_byte, self.lat, self.scale(replicas))
        return found

    def exposed_of(self, succ: Successor, rest: bool) -> np.ndarray:
        """``exposed`` of a successor's ranks (or of the rest), its ring looked up once."""
        if rest:
            key = succ.ring_rest
            if key is None:
                key = succ.ring_rest = self.ring_key(succ.rest)
        else:
            key = succ.ring_ranks
            if key is None:
                key = succ.ring_ranks = self.ring_key(succ.ranks)
        return self._exposed_by_key(key)

    def rest_unit(self, succ: Successor) -> float:
        """``p2p_unit`` from a successor's ranks to the rest, looked up once per successor."""
        unit = succ.unit_rest
        if unit is None:
            unit = succ.unit_rest = self.p2p_unit(succ.ranks, succ.rest)[0]
        return unit

    def complete_rows(self, cand: PartialPlan, stage: "NewStage", top: TopPlans) -> np.ndarray:
        """Price prefix + new stage [j, J) + the rest as one stage (formula 2, incrementally);
        record the plans that enter the top list; return the latencies (inf if invalid)."""
        fits = self._rest_fits(stage)
        valid = stage.inside & stage.complete_ok & (stage.tmax >= 2) & fits
        if not valid.any():
            return np.full(stage.fn.shape, _INF)
        rest = self._rest_stage(stage, fits, valid.any(axis=1).tolist())
        latency = self._four_phase_latency(cand, stage, rest)
        latency = np.where(valid, latency, _INF)
        thr = top.threshold
        n, j = self.t.n, cand.end
        for p, i in zip(*np.nonzero(latency < thr)):
            placement = stage.placements[p]
            jj = int(stage.ends[i])
            top.add(float(latency[p, i]), self.m, cand.stages + ((j, jj, placement.ranks), (jj, n, placement.rest)))
        return latency

    def _rest_fits(self, stage: "NewStage") -> np.ndarray:
        """Whether the layers [J, n) fit in memory as one last stage on the remaining ranks."""
        t, n = self.t, self.t.n
        ends = slice(int(stage.ends[0]), int(stage.ends[-1]) + 1)
        mem = t.params[ends, n][None, :] * self.weight_factor + self.k_of(1) * (t.stash[ends, n][None, :] * stage.s_rest)
        return mem <= self.cap

    def _rest_stage(self, stage: "NewStage", fits: np.ndarray, needed: list[bool]) -> "RestStage":
        """The layers [J, n) as one last stage on the remaining ranks, and the transfer into it.
        The transfer and AllReduce are looked up only for the ``needed`` rows (the others
        are masked out by the caller; they get zeros)."""
        t, n = self.t, self.t.n
        lo0, hi0 = int(stage.ends[0]), int(stage.ends[-1])
        ends = slice(lo0, hi0 + 1)
        out = (t.output[lo0 - 1 : hi0] * self.whole)[None, :]
        zeros = np.zeros(hi0 + 1 - lo0)
        units = np.array([self.rest_unit(p.successor) if use else 0.0 for p, use in zip(stage.placements, needed)])[:, None]
        return RestStage(
            fr=t.forward[ends, n][None, :] * stage.s_rest,
            br=t.backward[ends, n][None, :] * stage.s_rest,
            ar=np.stack([self.exposed_of(p.successor, True)[ends, n] if use else zeros for p, use in zip(stage.placements, needed)]),
            c2=np.where(out > 0, out * units + self.lat, 0.0),
            fits=fits,
        )

    def _four_phase_latency(self, cand: PartialPlan, stage: "NewStage", rest: "RestStage") -> np.ndarray:
        """Formula 2 over the prefix's phases and the new ones (transfer c1, stage n,
        transfer c2, rest R), with Algorithm 1's pivot found incrementally: among the new
        phases directly, inside the prefix through its pivot records."""
        m1 = self.m1
        fn, bn, an, c1 = stage.fn, stage.bn, stage.an, stage.c1
        fr, br, ar, c2 = rest.fr, rest.br, rest.ar, rest.c2
        fb1, fbn, fb2, fbr = 2.0 * c1, fn + bn, 2.0 * c2, fr + br
        # Algorithm 1 over the new phases (R, c2, n, c1); a = F+B after the phase being
        # checked up to and including the pivot (costs.walk_pivot)
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
        if not cand.stages:
            return latency
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




class NewStage(NamedTuple):
    """The next stage [j, J) for every placement (rows) and end J (columns): its forward,
    backward and exposed AllReduce times, the stages it leaves memory for (``tmax``), the
    transfer into it (``c1``), the slice scale of the rest and which rows may complete or
    extend."""

    placements: list[Placement]
    ends: np.ndarray
    inside: np.ndarray
    fn: np.ndarray
    bn: np.ndarray
    an: np.ndarray
    tmax: np.ndarray
    c1: np.ndarray
    s_rest: np.ndarray
    complete_ok: np.ndarray
    extend_ok: np.ndarray


class RestStage(NamedTuple):
    """The layers after J as one last stage: forward, backward, exposed AllReduce, the
    transfer into it and whether it fits in memory."""

    fr: np.ndarray
    br: np.ndarray
    ar: np.ndarray
    c2: np.ndarray
    fits: np.ndarray


class Features(NamedTuple):
    """What a successor sub-problem carries (``PartialPlan``'s fields), arrays or floats."""

    fn: Any
    bn: Any
    an: Any
    pf: Any
    tail: Any
    claim: Any
    max_fb: Any
    sum_fb: Any
    smax: Any
    lb: Any
    tpl: Any


class Pending(NamedTuple):
    """A successor before it becomes a ``PartialPlan``: its parent, the new stage [start,
    end), its placement and features."""

    cand: PartialPlan
    start: int
    end: int
    placement: Placement
    features: Features
