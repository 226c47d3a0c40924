"""Exhaustive planner for small instances: the ground truth the DP planner is tested against.

Every partition of the layers into consecutive stages, every replication count per stage
(summing to all G devices, each at most ``micro_batch_size // min_slice``), every placement
of those replicas on machines, and every candidate M are scored with the same cost model
as the planners: ``dapple_latency(stage_costs(...))`` (DAPPLE formulas 1-2) and the memory
filter ``stage_memory_bytes`` at K_i from ``warmup_counts`` (5.3).

Placements up to symmetry. Stage ranks are kept ascending (the plan convention), so a stage's
rank list visits its machines in machine order. Relabelling devices *within* a machine does
not change any cost: ``allreduce_ms`` looks only at how many machines a stage spans and
``p2p_ms`` only at the machine of each list position (two stages never share a device, and
per-device loads are just summed per device). So a placement is exactly described by how
many devices every stage has on every machine -- a count matrix whose rows sum to the
replica counts and whose columns sum to the devices per machine -- and we enumerate all such
matrices. Machines are *not* treated as interchangeable in general: their order decides the
split-concat pairing in ``p2p_ms``. The exception is one device per machine (configs B and C
of the paper): then every transfer between two stages crosses machines, each machine's link
carries exactly its one device's share, and a ring spans machines iff it has two or more
members, so only the replica counts matter and one canonical placement per count is scored.

The search is exhaustive up to a proven bound (``dapple_planner.lower_bound``): formula 2
is never below ``(M-1) max_s (F_s + B_s)`` over all stages, communication stages included,
nor below the F + B of a planned prefix plus M times the remaining work per remaining
device, so a partial plan whose bound already reaches the best latency found is not
completed. ``prune=False`` turns even that off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.costs import StageCost, dapple_latency, stage_costs
from lightning_dapple.plan.evaluate import Scored, memory_per_stage
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["EnumerationResult", "enumerate_best", "MAX_LAYERS", "MAX_DEVICES"]

MAX_LAYERS = 8
MAX_DEVICES = 8


@dataclass(frozen=True)
class EnumerationResult:
    best: Scored | None
    plans_scored: int

    @property
    def latency_ms(self) -> float:
        return self.best.latency_ms if self.best is not None else float("inf")


def _count_vectors(total: int, free: list[int]) -> Iterator[tuple[int, ...]]:
    """Every way to take ``total`` devices with at most ``free[k]`` from machine k."""
    if not free:
        if total == 0:
            yield ()
        return
    head, rest = free[0], free[1:]
    room = sum(rest)
    for take in range(max(0, total - room), min(head, total) + 1):
        for tail in _count_vectors(total - take, rest):
            yield (take, *tail)


def _first_free(total: int, free: list[int]) -> Iterator[tuple[int, ...]]:
    """One device per machine: which machines a stage takes does not matter (see module doc)."""
    counts = [0] * len(free)
    for k, room in enumerate(free):
        if total and room:
            counts[k] = 1
            total -= 1
    if total == 0:
        yield tuple(counts)


def enumerate_best(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    min_slice: int | None = None,
    prune: bool = True,
) -> EnumerationResult:
    """The plan with the lowest formula-2 latency that fits in memory, by brute force."""
    n, g = profile.num_layers, cluster.num_devices
    if n > MAX_LAYERS or g > MAX_DEVICES:
        raise ValueError(f"enumerate_best is for at most {MAX_LAYERS} layers and {MAX_DEVICES} devices, got {n} and {g}")
    request = PlanRequest.build(profile, cluster, global_batch_size, micro_batches, schedule, policy, min_slice=min_slice)
    walk = _Enumeration(profile, cluster, schedule, policy, prune)
    for m in request.micro_batches:
        mbs = global_batch_size // m
        rmax = min(mbs // request.floor, mbs)
        if rmax >= 1:
            walk.run(m, mbs, rmax)
    return EnumerationResult(walk.best, walk.scored)


class _Enumeration:
    """Every partition, replication and machine assignment for one M after another, with
    the branch-and-bound of ``dapple_planner.lower_bound`` when ``prune``."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, schedule: str, policy: str, prune: bool) -> None:
        self.profile, self.cluster, self.schedule, self.policy, self.prune = profile, cluster, schedule, policy, prune
        self.per = cluster.devices_per_machine
        self.best: Scored | None = None
        self.scored = 0
        n = profile.num_layers
        # work[a]: F + B of layers a.. at the profile's batch (for the bound)
        self.work = [0.0] * (n + 1)
        for a in range(n - 1, -1, -1):
            self.work[a] = self.work[a + 1] + profile.layers[a].forward_ms + profile.layers[a].backward_ms

    def run(self, m: int, mbs: int, rmax: int) -> None:
        self.m, self.mbs, self.rmax = m, mbs, rmax
        self.cache: dict[tuple, StageCost] = {}
        self.rec(0, [self.per] * self.cluster.machines, [], 0.0, 0.0)

    def ranks_of(self, counts: tuple[int, ...]) -> tuple[int, ...]:
        """Representative ranks: the first ones of each machine (any others cost the same)."""
        return tuple(k * self.per + i for k, c in enumerate(counts) for i in range(c))

    def cost(self, a: int, b: int, counts: tuple[int, ...], nxt: tuple | None) -> StageCost:
        key = (a, b, counts, nxt)
        if key not in self.cache:
            stages = [StagePlan(layers=(a, b), devices=self.ranks_of(counts))]
            if nxt is not None:
                # receivers on the same machines take ranks after the senders'
                recv = tuple(k * self.per + (counts[k] + i) % self.per for k, c in enumerate(nxt[1]) for i in range(c))
                stages.append(StagePlan(layers=(b, nxt[0]), devices=recv))
            self.cache[key] = stage_costs(self.profile, self.cluster, stages, self.mbs)[0]
        return self.cache[key]

    def complete(self, chosen: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Price a complete plan; keep it if it fits and beats the best so far."""
        costs = [
            self.cost(a, b, c, (chosen[i + 1][1], chosen[i + 1][2]) if i + 1 < len(chosen) else None)
            for i, (a, b, c) in enumerate(chosen)
        ]
        self.scored += 1
        memory = memory_per_stage(costs, self.m, self.cluster, self.policy, self.schedule)
        if max(memory) > self.cluster.device_memory_bytes:
            return
        prediction = dapple_latency(costs, self.m, memory)
        best = self.best
        if best is None or prediction.latency_ms < best.latency_ms - 1e-12 * max(1.0, best.latency_ms):
            stages = tuple(StagePlan(layers=(a, b), devices=d) for (a, b, _), d in zip(chosen, _concrete(chosen, self.cluster)))
            self.best = Scored(stages, self.m, prediction, tuple(costs))

    def rec(self, start: int, free: list[int], chosen: list[tuple[int, int, tuple[int, ...]]], known_max: float, known_sum: float) -> None:
        """Extend ``chosen`` (stages up to ``start``) in every way; ``known_max`` /
        ``known_sum``: F+B of every chosen stage and of every transfer between them."""
        n, left = self.profile.num_layers, sum(free)
        if start == n:
            if not left:
                self.complete(chosen)
            return
        if left == 0:
            return
        for end in range(start + 1, n + 1):
            if end == n:
                sizes = [left] if left <= self.rmax else []
            else:
                sizes = list(range(1, min(left - 1, self.rmax) + 1))
            for r in sizes:
                for counts in (_count_vectors(r, free) if self.per > 1 else _first_free(r, free)):
                    self.extend(start, end, r, counts, free, chosen, known_max, known_sum)

    def extend(self, start: int, end: int, r: int, counts: tuple[int, ...], free: list[int], chosen: list, known_max: float, known_sum: float) -> None:
        """Add stage [start, end) on ``counts`` devices per machine unless the bound prunes it."""
        own = self.cost(start, end, counts, None)
        new_max = max(known_max, own.forward_ms + own.backward_ms)
        new_sum = known_sum + own.forward_ms + own.backward_ms
        if chosen:
            a, b, c = chosen[-1]
            send = self.cost(a, b, c, (end, counts)).send_ms
            new_max = max(new_max, 2 * send)
            new_sum += 2 * send
        if self.prune and self.best is not None:
            devices_left = sum(free) - r
            rest = self.work[end] * (self.mbs / self.profile.micro_batch_size) / devices_left if devices_left else 0.0
            if max((self.m - 1) * new_max, new_sum + self.m * rest) >= self.best.latency_ms:
                return
        chosen.append((start, end, counts))
        self.rec(end, [f - c for f, c in zip(free, counts)], chosen, new_max, new_sum)
        chosen.pop()


def _concrete(chosen: list[tuple[int, int, tuple[int, ...]]], cluster: Cluster) -> list[tuple[int, ...]]:
    """Real, disjoint ranks for a count matrix: lowest free ranks per machine, stage by stage."""
    per = cluster.devices_per_machine
    used = [0] * cluster.machines
    out = []
    for _, _, counts in chosen:
        ranks = []
        for k, c in enumerate(counts):
            ranks.extend(k * per + used[k] + i for i in range(c))
            used[k] += c
        out.append(tuple(sorted(ranks)))
    return out
