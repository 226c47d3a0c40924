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
from lightning_dapple.plan.partial import PartialPlan, TopPlans, beam_select, dominates, rank
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
    ranks) for the replica counts asked so far, as rows in the order ``expand`` visits them
    (replica count, then policy), with the per-row numbers it prices as arrays, so that a
    sub-problem's successors are selected and priced without a Python loop per placement."""

    __slots__ = ("by_r", "rows", "r", "unit_in", "rest_len", "ring", "ring_rest", "unit_rest")

    def __init__(self) -> None:
        self.by_r: dict[int, list[Successor]] = {}
        self.rebuild()

    def rebuild(self) -> None:
        """Rows and arrays after replica counts were added (rows sorted by replica count)."""
        rows = [succ for r in sorted(self.by_r) for succ in self.by_r[r]]
        self.rows = rows
        self.r = np.array([succ.r for succ in rows], dtype=np.intp)
        self.unit_in = np.array([succ.unit_in for succ in rows], dtype=float)
        self.rest_len = np.array([len(succ.rest) for succ in rows], dtype=np.intp)
        self.ring = np.array([succ.ring_ranks for succ in rows], dtype=np.intp)
        self.ring_rest = np.array([succ.ring_rest for succ in rows], dtype=np.intp)
        self.unit_rest = np.array([np.nan if succ.unit_rest is None else succ.unit_rest for succ in rows], dtype=float)


class SharedMemo:
    """Memo tables that do not depend on M: placements offered per placement state,
    transfer units per machine pattern, ring AllReduce parameters."""

    def __init__(self) -> None:
        self.blocks: dict[tuple, SuccessorBlock] = {}
        self.p2p: dict[tuple, tuple[float, float]] = {}
        self.rings: dict[tuple[int, ...], tuple[float, float]] = {}
        self.ring_ids: dict[tuple[int, float], int] = {}
        self.ring_keys: list[tuple[int, float]] = []

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
        self.weight_factor = 2.0 + cluster.optimizer_state_factor
        self.lat = cluster.latency_ms
        self.per = cluster.devices_per_machine
        self._scales = [0.0] + [slice_size(self.mbs, r) / tables.pbs for r in range(1, cluster.num_devices + 1)]
        self._scale_array = np.array(self._scales)
        self._exposed: dict[tuple[int, float], np.ndarray] = {}
        self._exposed_ids: dict[int, np.ndarray] = {}
        self._last = np.zeros((0, tables.n + 1))  # [ring id, J]: exposed tail of [J, n)
        self._last_have = np.zeros(0, dtype=bool)
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
        # is placed), so p2p_ms depends only on which of them share a machine: every
        # split-concat piece's route and each sender's and receiver's byte sums are the same,
        # and the per-machine sums only trade places when machines are renamed. Machines are
        # therefore named by first appearance (senders, then receivers).
        per = self.per
        names: dict[int, int] = {}
        key = (
            tuple([names.setdefault(rank // per, len(names)) for rank in senders]),
            tuple([names.setdefault(rank // per, len(names)) for rank in receivers]),
        )
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
        return self.block(occupied, last, [r]).by_r[r]

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
        state = PlacementState(self.cluster, occupied)
        everyone = frozenset(range(self.cluster.num_devices))
        extended = self.settings.extended and self.cluster.num_devices <= EXTENDED_PLACEMENT_DEVICES
        near = last if self.settings.extended else None  # the paper's three policies alone without it
        found = []
        for _, ranks in placement_options(state, r, near=near, extended=extended):
            taken = occupied.union(ranks)
            rest = tuple(sorted(everyone.difference(taken)))
            succ = Successor(r, ranks, taken, rest)
            if last is not None:
                succ.unit_in = self.p2p_unit(last, ranks)[0]
            succ.ring_ranks = self.shared.ring_id(self.ring_key(ranks))
            succ.ring_rest = self.shared.ring_id(self.ring_key(rest))
            found.append(succ)
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
        usable = mask.any(axis=1)
        if not usable.any():
            return
        stage = self._new_stage(cand, free, sizes, mask, usable.tolist(), top.threshold)
        if stage is None:
            return
        tpl = None
        if stage.complete_ok.any():
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
        replicas = np.array(sizes)
        s_r = self._scale_array[replicas][:, None]
        per_rest = ((self.m * self.whole) / (free - replicas))[:, None]
        room = thr - cand.sum_fb
        fbn_low = t.work[j, j + 1 : n][None, :] * s_r
        mask = (fbn_low < room) & (t.work[j + 1 : n, n][None, :] * per_rest < room)
        if self.m1 >= 1:
            mask &= self.m1 * fbn_low < thr
        return mask

    def _new_stage(self, cand: PartialPlan, free: int, sizes: list[int], mask: np.ndarray, usable: list[bool], thr: float) -> "NewStage | None":
        """The new stage [j, J) for every placement the policies offer (4.2; rows) and end J
        (columns), with the transfer into it; None when no placement passes the bound."""
        t, j, last, k = self.t, cand.end, cand.last, len(cand.stages)
        g = self.cluster.num_devices
        wanted = [r for r, ok in zip(sizes, usable) if ok]
        block = self.block(cand.occupied, last, wanted)
        chosen = np.zeros(g + 1, dtype=bool)
        chosen[wanted] = True
        rows = np.flatnonzero(chosen[block.r])
        boundary = float(t.output[j - 1] * self.whole) if j > 0 else 0.0
        if last is not None and boundary > 0:
            c1 = boundary * block.unit_in[rows] + self.lat
            if self.m1 >= 1:
                keep = self.m1 * np.maximum(cand.max_fb, 2.0 * c1) < thr
                rows, c1 = rows[keep], c1[keep]
        else:
            if self.m1 >= 1 and self.m1 * max(cand.max_fb, 0.0) >= thr:
                return None
            c1 = np.zeros(rows.size)
        if rows.size == 0:
            return None
        replicas = block.r[rows]
        mask_row = np.zeros(g + 1, dtype=np.intp)
        mask_row[sizes] = np.arange(len(sizes))
        inside_all = mask[mask_row[replicas]]
        columns = np.flatnonzero(inside_all.any(axis=0))
        lo0, hi0 = j + 1 + int(columns[0]), j + 1 + int(columns[-1])
        s_r = self._scale_array[replicas][:, None]
        rest = block.rest_len[rows]
        complete_ok = rest <= self.rmax
        if self.settings.straight_only:
            complete_ok &= rest == 1
        fn = t.forward[j, lo0 : hi0 + 1][None, :] * s_r
        bn = t.backward[j, lo0 : hi0 + 1][None, :] * s_r
        return NewStage(
            block=block,
            rows=rows,
            ends=np.arange(lo0, hi0 + 1),
            inside=inside_all[:, columns[0] : columns[-1] + 1],
            fn=fn,
            bn=bn,
            fbn=fn + bn,
            an=self._exposed_rows(block.ring[rows], j, lo0, hi0 + 1),
            tmax=self.tmax_table(j)[replicas, lo0 : hi0 + 1],
            c1=c1[:, None],
            rest=rest,
            s_rest=np.where(rest <= self.rmax, self._scale_array[rest], 0.0)[:, None],
            complete_ok=complete_ok[:, None],
            extend_ok=(rest >= 2)[:, None] if cand.smax >= k + 3 else np.zeros((rows.size, 1), dtype=bool),
        )

    def _extend(self, cand: PartialPlan, stage: "NewStage", tpl: np.ndarray | None, states: list[dict[Any, list[PartialPlan]]], top: TopPlans) -> None:
        """Admit the successors that stay sub-problems (the layers after J still to split)."""
        if self.shallow:
            return
        t, n = self.t, self.t.n
        J = stage.ends
        ok = stage.inside & stage.extend_ok & (stage.tmax >= 3)
        if J[-1] > n - 2:
            ok &= J[None, :] <= n - 2
        if not ok.any():
            return
        remaining = t.work[int(J[0]) : int(J[-1]) + 1, n][None, :] * (self.whole / stage.rest.astype(float)[:, None])
        fb1, fbn = 2.0 * stage.c1, stage.fbn
        max_fb = np.maximum(np.maximum(cand.max_fb, fb1), fbn)
        sum_fb = cand.sum_fb + fb1 + fbn
        lb = self.bound(max_fb, sum_fb, remaining)
        ok &= lb < top.threshold
        beam = self.settings.beam is not None
        if beam:
            width = self.settings.beam_insert
            pending = self._pending
            cut = np.array([-pending[jj][0][0] if len(pending[jj]) >= width else _INF for jj in J.tolist()])
            ok &= lb < cut[None, :]
        rows, columns = np.nonzero(ok)
        if rows.size == 0:
            return
        # the admitted successors' numbers as Python floats, gathered at once; the rest of
        # their features is derived from them when (if) they become sub-problems
        gathered = [array[rows, columns].tolist() for array in (stage.fn, stage.bn, stage.an, stage.tmax, lb)]
        gathered.append(tpl[rows, columns].tolist() if tpl is not None else [_INF] * rows.size)
        c1 = stage.c1[:, 0].tolist()
        succs = stage.block.rows
        index = stage.rows.tolist()
        start = cand.end
        for p, end, fn, bn, an, tmax, value, tp in zip(rows.tolist(), J[columns].tolist(), *gathered):
            pending_entry = Pending(cand, start, end, succs[index[p]], c1[p], fn, bn, an, tmax, value, tp)
            if beam:
                heap = pending[end]
                if len(heap) < width:
                    self._seq += 1
                    heapq.heappush(heap, (-value, self._seq, pending_entry))
                elif value < -heap[0][0]:
                    self._seq += 1
                    heapq.heapreplace(heap, (-value, self._seq, pending_entry))
            else:
                self._insert_pending(pending_entry, states)

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
        bound in ``_extend``)."""
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

    def _exposed_table(self, ring: int) -> np.ndarray:
        """``exposed`` by ring id."""
        found = self._exposed_ids.get(ring)
        if found is None:
            found = self._exposed_ids[ring] = self._exposed_by_key(self.shared.ring_keys[ring])
        return found

    def _exposed_rows(self, rings: np.ndarray, j: int, lo: int, hi: int) -> np.ndarray:
        """Exposed tails of [j, J) for J in [lo, hi), one row per ring id."""
        table = self._exposed_table
        return np.array([table(ring)[j] for ring in rings.tolist()])[:, lo:hi]

    def _exposed_last(self, rings: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Exposed tails of [J, n) for J in [lo, hi), one row per ring id (a per-ring column
        of the tables kept as one array)."""
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
            self._last[ring] = self._exposed_table(ring)[:, self.t.n]
            self._last_have[ring] = True
        return self._last[rings, lo:hi]

    def rest_unit(self, succ: Successor) -> float:
        """``p2p_unit`` from a successor's ranks to the rest, looked up once per successor."""
        unit = succ.unit_rest
        if unit is None:
            unit = succ.unit_rest = self.p2p_unit(succ.ranks, succ.rest)[0]
        return unit

    def complete_rows(self, cand: PartialPlan, stage: "NewStage", top: TopPlans) -> np.ndarray | None:
        """Price prefix + new stage [j, J) + the rest as one stage (formula 2, incrementally);
        record the plans that enter the top list; return the latencies (inf if invalid, None
        if all are)."""
        fits = self._rest_fits(stage)
        valid = stage.inside & stage.complete_ok & (stage.tmax >= 2) & fits
        needed = valid.any(axis=1)
        if not needed.any():
            return None
        rest = self._rest_stage(stage, fits, needed)
        latency = self._four_phase_latency(cand, stage, rest)
        latency = np.where(valid, latency, _INF)
        thr = top.threshold
        rows, columns = np.nonzero(latency < thr)
        if rows.size:
            n, j = self.t.n, cand.end
            succs, index = stage.block.rows, stage.rows
            for p, i, jj, value in zip(rows.tolist(), columns.tolist(), stage.ends[columns].tolist(), latency[rows, columns].tolist()):
                succ = succs[int(index[p])]
                top.add(value, self.m, cand.stages + ((j, jj, succ.ranks), (jj, n, succ.rest)))
        return latency

    def _rest_fits(self, stage: "NewStage") -> np.ndarray:
        """Whether the layers [J, n) fit in memory as one last stage on the remaining ranks."""
        t, n = self.t, self.t.n
        ends = slice(int(stage.ends[0]), int(stage.ends[-1]) + 1)
        mem = t.params[ends, n][None, :] * self.weight_factor + self.k_of(1) * (t.stash[ends, n][None, :] * stage.s_rest)
        return mem <= self.cap

    def _rest_stage(self, stage: "NewStage", fits: np.ndarray, needed: np.ndarray) -> "RestStage":
        """The layers [J, n) as one last stage on the remaining ranks, and the transfer into it.
        The transfer is looked up only for the ``needed`` rows (the others are masked out by
        the caller; they get zeros)."""
        t, n = self.t, self.t.n
        lo0, hi0 = int(stage.ends[0]), int(stage.ends[-1])
        ends = slice(lo0, hi0 + 1)
        out = (t.output[lo0 - 1 : hi0] * self.whole)[None, :]
        block, rows = stage.block, stage.rows
        units = block.unit_rest[rows]
        unknown = needed & np.isnan(units)
        if unknown.any():
            for at in rows[unknown].tolist():
                block.unit_rest[at] = self.rest_unit(block.rows[at])
            units = block.unit_rest[rows]
        units = np.where(needed, units, 0.0)[:, None]
        return RestStage(
            fr=t.forward[ends, n][None, :] * stage.s_rest,
            br=t.backward[ends, n][None, :] * stage.s_rest,
            ar=self._exposed_last(block.ring_rest[rows], lo0, hi0 + 1),
            c2=np.where(out > 0, out * units + self.lat, 0.0),
            fits=fits,
        )

    def _four_phase_latency(self, cand: PartialPlan, stage: "NewStage", rest: "RestStage") -> np.ndarray:
        """Formula 2 over the prefix's phases and the new ones (transfer c1, stage n,
        transfer c2, rest R), with Algorithm 1's pivot found incrementally: among the new
        phases directly, inside the prefix through its pivot records."""
        m1 = self.m1
        fn, bn, an, c1, fbn = stage.fn, stage.bn, stage.an, stage.c1, stage.fbn
        fr, br, ar, c2 = rest.fr, rest.br, rest.ar, rest.c2
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
        b1, b2 = c1, c2
        w0 = cand.pf + c1
        w1 = w0 + fn
        w2 = w1 + c2
        w3 = w2 + fr
        # the ending phase for each pivot position (costs.ending_phase), sharing the sums
        # that are accumulated in the same order
        e1 = cand.tail + b1
        e2 = e1 + bn
        e3 = e2 + b2
        u1 = an + bn
        u2 = u1 + b2
        end3 = np.maximum(np.maximum(e3 + br, u2 + br), np.maximum(b2 + br, ar + br))
        end2 = np.maximum(np.maximum(e3, u2), np.maximum(b2, ar - br))
        end1 = np.maximum(np.maximum(e2, u1), np.maximum(-b2, ar - b2 - br))
        end0 = np.maximum(np.maximum(e1, an - bn), np.maximum(-bn - b2, ar - bn - b2 - br))
        latency = np.choose(q, (w0, w1, w2, w3)) + v + np.choose(q, (end0, end1, end2, end3))
        if not cand.stages:
            return latency
        rec_h, rec_ws, rec_e, rec_bq = cand.record_arrays(m1)
        idx = np.searchsorted(rec_h, v + a, side="right")
        inner = idx < rec_h.size
        if inner.any():
            ii = np.minimum(idx, rec_h.size - 1)
            bq = rec_bq[ii]
            end_in = np.maximum(np.maximum(rec_e[ii], an - bq - b1 - bn), ar - bq - b1 - bn - b2 - br)
            latency = np.where(inner, rec_ws[ii] + end_in, latency)
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
    """The next stage [j, J) for every placement (rows: ``rows`` of ``block``) and end J
    (columns): its forward, backward and exposed AllReduce times, the stages it leaves
    memory for (``tmax``), the transfer into it (``c1``), the devices left and their slice
    scale, and which rows may complete or extend."""

    block: SuccessorBlock
    rows: np.ndarray
    ends: np.ndarray
    inside: np.ndarray
    fn: np.ndarray
    bn: np.ndarray
    fbn: np.ndarray
    an: np.ndarray
    tmax: np.ndarray
    c1: np.ndarray
    rest: np.ndarray
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
