"""PipeDream's partitioner (PipeDream 3.2) as a baseline, mapped onto DAPPLE's plan format.

PipeDream minimises the time of the slowest stage, ``A(N, M)``:

    T(i -> j, m) = (1/m) max( sum_l T_l , sum_l W_l^m )
    A(j, m)      = min( T(1 -> j, m),
                        min_{i<j} min_{m'<m} max( A(i, m - m'), 2 C_i, T(i+1 -> j, m') ) )

with ``T_l`` the forward+backward time of layer l, ``C_i`` the time to send layer i's
activations, and ``W_l^m`` the weight synchronisation time of layer l among m replicas,
estimated from the ``4 (m-1) |w_l| / m`` bytes the paper says a worker moves per step in a
data-parallel configuration (push and pull through parameter servers).

Hierarchical topologies are planned level by level, as PipeDream does for servers with
several GPUs (the extension of 3.2 in the journal/SOSP version of the paper): first, for
every block of consecutive layers, the best pipeline *inside one machine* over its
``devices_per_machine`` devices (intra-machine bandwidth for ``C`` and ``W``); then the
recurrence above *across machines*, where a block replicated on m' machines costs
``(1/m') max(A_machine(block), W^{m'})`` with the network bandwidth. On a flat cluster (one
device per machine) or a single machine this is exactly the recurrence printed above.

Mapping onto ``Plan``: a machine-level stage spanning m' machines whose in-machine pipeline
has stages with r_1 .. r_k devices becomes k plan stages replicated r_t x m' ways (the
same device offsets on each of its machines); ranks are handed out in order, machine by
machine. PipeDream replicates by round-robin over whole minibatches; DAPPLE's runtime splits
a micro-batch over the replicas instead (5.2.2), which is what the shared cost model prices.

PipeDream has no number of micro-batches (it is asynchronous), so M is chosen by us: among
the candidate M (the same divisors and slice floor as the DAPPLE planner) we keep the one
whose PipeDream partition has the lowest formula-2 latency and fits in memory. The plan is
scored with the shared cost model and simulated like DAPPLE's, so the two are comparable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.evaluate import (
    Scored,
    candidate_micro_batches,
    check_inputs,
    default_min_slice,
    finish_plan,
    raise_no_memory,
    score_stages,
    simulate_or_none,
    subcluster,
)
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["plan_pipedream", "pipedream_partition", "PipeDreamResult"]

_INF = float("inf")


@dataclass(frozen=True)
class PipeDreamResult:
    """A PipeDream partition: plan stages and the objective A(N, M) it minimised."""

    stages: tuple[StagePlan, ...]
    slowest_stage_ms: float


class _Level:
    """Range sums of one level of the recurrence (in-machine or across machines)."""

    def __init__(self, compute: np.ndarray, weights: np.ndarray, activations: np.ndarray, bandwidth_bytes_per_ms: float, latency_ms: float) -> None:
        self.n = len(compute)
        c = np.concatenate([[0.0], np.cumsum(compute)])
        w = np.concatenate([[0.0], np.cumsum(weights)])
        self.compute = c[None, :] - c[:, None]  # [i, j]: layers [i, j)
        self.weights = w[None, :] - w[:, None]
        self.bpm = bandwidth_bytes_per_ms
        self.latency = latency_ms
        # C of a cut before layer s (s = 1..n-1): layer s-1's activations over the link
        self.comm = np.zeros(self.n + 1)
        sizes = np.asarray(activations, dtype=float)
        self.comm[1 : self.n + 1] = np.where(sizes > 0, sizes / self.bpm + self.latency, 0.0)

    def stage(self, m: int) -> np.ndarray:
        """T(i -> j, m) for all [i, j): (1/m) max(compute, W^m), W^m from 4 (m-1) |w| / m bytes."""
        if m <= 1:
            return self.compute / m
        sync = 4.0 * (m - 1) / m * self.weights / self.bpm + self.latency
        return np.maximum(self.compute, sync) / m


def _recurrence(level: _Level, units: int, single: Any, allowed: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A(i -> j, m) for m <= ``units`` by PipeDream's recurrence, for every start i.

    ``single(m)`` gives the (n+1, n+1) table of one stage on m units; ``allowed(m)`` says
    whether a stage may take m units. Returns best[i, j, m] and the choice arrays split[i, j, m]
    (-1: one stage) and last_units[i, j, m] to rebuild the partition.
    """
    n = level.n
    best = np.full((n + 1, n + 1, units + 1), _INF)
    split = np.full((n + 1, n + 1, units + 1), -1, dtype=int)
    last_units = np.zeros((n + 1, n + 1, units + 1), dtype=int)
    singles = {m: single(m) for m in range(1, units + 1) if allowed(m)}
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)  # [s, j]: s < j
    two_c = 2.0 * level.comm
    for i in range(n):
        for m in range(1, units + 1):
            value = singles[m][i].copy() if m in singles else np.full(n + 1, _INF)
            pick_s = np.full(n + 1, -1, dtype=int)
            pick_u = np.zeros(n + 1, dtype=int)
            for mm in range(1, m):
                if mm not in singles:
                    continue
                head = best[i, :, m - mm]  # [s]
                cand = np.maximum(np.maximum(head, two_c)[:, None], singles[mm])
                cand = np.where(upper, cand, _INF)
                cand[: i + 1, :] = _INF
                mins = cand.min(axis=0)
                better = mins < value
                if better.any():
                    args = cand.argmin(axis=0)
                    value = np.where(better, mins, value)
                    pick_s = np.where(better, args, pick_s)
                    pick_u = np.where(better, mm, pick_u)
            value[: i + 1] = _INF
            best[i, :, m] = value
            split[i, :, m] = pick_s
            last_units[i, :, m] = pick_u
    return best, split, last_units


def _rebuild(split: np.ndarray, last_units: np.ndarray, i: int, j: int, m: int) -> list[tuple[int, int, int]]:
    s = int(split[i, j, m])
    if s < 0:
        return [(i, j, m)]
    mm = int(last_units[i, j, m])
    return _rebuild(split, last_units, i, s, m - mm) + [(s, j, mm)]


def pipedream_partition(profile: ModelProfile, cluster: Cluster, micro_batch_size: int, max_replicas: int) -> PipeDreamResult | None:
    """PipeDream 3.2's partition for micro-batches of ``micro_batch_size`` samples.

    ``max_replicas`` bounds the replicas of any plan stage (the slice floor). Returns None
    when no partition respects it.
    """
    whole = profile.scale(micro_batch_size)
    compute = np.array([(layer.forward_ms + layer.backward_ms) * whole for layer in profile.layers])
    weights = np.array([layer.param_bytes for layer in profile.layers])
    activations = np.array([layer.output_bytes * whole for layer in profile.layers])
    n = profile.num_layers
    per, machines = cluster.devices_per_machine, cluster.machines
    inter = _Level(compute, weights, activations, cluster.bytes_per_ms(cluster.inter_bandwidth_gbps), cluster.latency_ms)
    if per == 1 or machines == 1:
        # one level: the printed recurrence over the devices (flat cluster or one machine)
        level = inter if per == 1 else _Level(compute, weights, activations, cluster.bytes_per_ms(cluster.intra_bandwidth_gbps), cluster.latency_ms)
        units = machines * per
        best, split, last_units = _recurrence(level, units, level.stage, lambda m: m <= max_replicas)
        value = float(best[0, n, units])
        if value == _INF:
            return None
        inner = _rebuild(split, last_units, 0, n, units)
        return PipeDreamResult(_flat_stages(inner), value)
    intra = _Level(compute, weights, activations, cluster.bytes_per_ms(cluster.intra_bandwidth_gbps), cluster.latency_ms)
    in_machine: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def machine_table(cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cap = min(cap, per)
        if cap not in in_machine:
            in_machine[cap] = _recurrence(intra, per, intra.stage, lambda m: m <= cap)
        return in_machine[cap]

    def block_stage(mm: int) -> np.ndarray:
        """A block of whole machines replicated on mm machines: (1/mm) max(A_machine, W^mm)."""
        cap = max_replicas // mm
        if cap < 1:
            return np.full((n + 1, n + 1), _INF)
        best_in = machine_table(cap)[0][:, :, per]
        if mm == 1:
            return best_in
        sync = 4.0 * (mm - 1) / mm * inter.weights / inter.bpm + inter.latency
        return np.maximum(best_in, sync) / mm

    best, split, last_units = _recurrence(inter, machines, block_stage, lambda m: max_replicas // m >= 1)
    value = float(best[0, n, machines])
    if value == _INF:
        return None
    blocks = []
    for a, b, mm in _rebuild(split, last_units, 0, n, machines):
        _, s_in, u_in = machine_table(max_replicas // mm)
        blocks.append((a, b, mm, _rebuild(s_in, u_in, a, b, per)))
    return PipeDreamResult(_to_plan_stages(blocks, per), value)


def _flat_stages(inner: list[tuple[int, int, int]]) -> tuple[StagePlan, ...]:
    stages = []
    rank = 0
    for a, b, units in inner:
        stages.append(StagePlan(layers=(a, b), devices=tuple(range(rank, rank + units))))
        rank += units
    return tuple(stages)


def _to_plan_stages(blocks: list[tuple[int, int, int, list]], per: int) -> tuple[StagePlan, ...]:
    """Machine-level blocks (start, end, machines, in-machine stages) -> plan stages, ranks in order."""
    stages = []
    machine = 0
    for _, _, count, inner in blocks:
        offset = 0
        for start, end, replicas in inner:
            devices = tuple(
                (machine + k) * per + offset + d for k in range(count) for d in range(replicas)
            )
            stages.append(StagePlan(layers=(start, end), devices=tuple(sorted(devices))))
            offset += replicas
        machine += count
    return tuple(stages)


def plan_pipedream(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    micro_batches: int | None = None,
    schedule: str = "dapple",
    policy: str = "PA",
    num_devices: int | None = None,
    min_slice: int | None = None,
    simulate: bool = True,
) -> Plan:
    """Plan with PipeDream's partitioner (3.2), priced and scheduled like a DAPPLE plan."""
    check_inputs(schedule, policy, global_batch_size)
    cluster = subcluster(cluster, num_devices)
    floor = default_min_slice(profile, min_slice)
    candidates, floor = candidate_micro_batches(global_batch_size, floor, micro_batches)
    scored: list[tuple[Scored, float]] = []
    for m in candidates:
        mbs = global_batch_size // m
        rmax = min(mbs // floor, mbs)
        if rmax < 1:
            continue
        result = pipedream_partition(profile, cluster, mbs, rmax)
        if result is None:
            continue
        scored.append((score_stages(profile, cluster, result.stages, global_batch_size, m, policy, schedule), result.slowest_stage_ms))
    if not scored:
        raise DappleConfigError(
            "global_batch_size",
            f"PipeDream finds no partition of {profile.num_layers} layers over {cluster.num_devices} devices with slices of at least {floor} samples",
            "use a larger global batch or fewer devices",
        )
    fitting = [pair for pair in scored if pair[0].fits(cluster)]
    if not fitting:
        smallest = min(scored, key=lambda pair: pair[0].peak_memory_bytes)[0]
        raise_no_memory(profile, cluster, smallest.peak_memory_bytes, f"PipeDream's {smallest.kind()} plan, M={smallest.micro_batches}")
    chosen, slowest = min(fitting, key=lambda pair: (pair[0].latency_ms, pair[0].micro_batches))
    bare = Plan(global_batch_size=global_batch_size, micro_batches=chosen.micro_batches, stages=chosen.stages, schedule=schedule, policy=policy)
    sim = simulate_or_none(bare, profile, cluster) if simulate else None
    kind = chosen.kind()
    reason = (
        f"PipeDream 3.2: {kind} plan (layers {':'.join(str(s.end - s.start) for s in chosen.stages)}) "
        f"minimises the slowest stage to {slowest:.1f} ms per micro-batch; M={chosen.micro_batches} has the lowest formula-2 latency "
        f"({chosen.latency_ms:.1f} ms)"
    )
    return finish_plan(chosen, profile, cluster, global_batch_size, policy, schedule, "pipedream", reason, sim, {"slowest_stage_ms": slowest})
