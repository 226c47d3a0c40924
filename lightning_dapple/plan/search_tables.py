"""Range sums of a profile and the fast split-concat transfer time, for the planner's search.

The search prices thousands of stages per second; these tables give any layer range's
forward, backward, parameter and stash sums in O(1) (the stash's per-sample and whole parts
apart: ``stash_bytes``), summed exactly as ``costs.stage_costs`` sums them, and every cut's bytes (per-sample part scaled, whole part once) (so ties in DAPPLE's Algorithm 1 resolve the same way in the search and in the
official formula), plus every range's tail after its last backward: the exposed AllReduce of
``overlap.OverlapTables`` and the optimizer step (``StageCost.tail_ms``), under ZeRO with the
replica's share of the step, the parameter exchange after it and, for ``zero=2``, the
gradients' reduce in place of the AllReduce (``costs.zero_exchange_ms``, ``costs.zero_reduce_ms``).
The user's step around the layers (``ModelProfile.step_glue_ms``), a fixed time on the
first and last stages, is not in the range sums, and the search prices a stage's backward
without its gradient accumulations (``LayerProfile.accumulate_ms``, ``accumulate`` here, which
``polish`` reads): the search's bounds stay bounds without them, and every result is
re-priced with both by ``score_stages``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.overlap import OverlapTables
from lightning_dapple.profile.model_profile import ModelProfile, cut_bytes

__all__ = ["RangeTables", "p2p_ms_fast"]


class RangeTables:
    """Per-profile range sums, accumulated exactly as ``stage_costs`` sums them (so ties in
    Algorithm 1 resolve the same way in the search and in the official formula)."""

    def __init__(self, profile: ModelProfile) -> None:
        layers = profile.layers
        n = len(layers)
        self.n = n
        self.pbs = profile.micro_batch_size
        self.overhead = profile.action_overhead_ms  # per action, whatever the range
        self.glue = profile.step_glue_ms  # per micro-batch, on the ranges [0, b) and [a, n)
        self.forward = self._range_sums([layer.forward_ms for layer in layers])
        self.backward = self._range_sums([layer.backward_ms for layer in layers])
        self.params = self._range_sums([layer.param_bytes for layer in layers])
        # a span's first layer stashes all it saves, the others less what they share with the layer before
        self.stash = self._range_sums(
            [layer.stash_bytes - layer.stash_shared_bytes for layer in layers], first=[layer.stash_bytes for layer in layers]
        )
        self.stash_whole = self._range_sums(
            [layer.stash_whole_bytes - layer.stash_shared_whole_bytes for layer in layers],
            first=[layer.stash_whole_bytes for layer in layers],
        )
        self.work = self.forward + self.backward
        self.output = np.array([layer.output_bytes for layer in layers], dtype=float)
        self.output_whole = np.array([layer.output_whole_bytes for layer in layers], dtype=float)
        self.overlap = OverlapTables([layer.param_bytes for layer in layers], [layer.backward_ms for layer in layers])
        self.optimizer = self._range_sums([layer.optimizer_ms for layer in layers])
        self.accumulate = self._range_sums([layer.accumulate_ms for layer in layers])
        self._exchanges: dict[tuple[float, float, int], np.ndarray] = {}

    def tail(self, a: float, latency: float, s: float, replicas: int = 1, zero: int = 0) -> np.ndarray:
        """``StageCost.tail_ms`` of every range [j, J) (rows j, columns J): the exposed
        AllReduce tail (``OverlapTables.tail``) plus the range's optimizer step, for a stage
        of ``replicas`` at ZeRO level ``zero`` (``_sharded``)."""
        if _sharded(a, replicas, zero):
            sync_a, sync_latency = _sync(a, latency, replicas, zero)
            return self.overlap.tail(sync_a, sync_latency, s) + self.optimizer / replicas + self._exchange(a, latency, replicas)
        return self.overlap.tail(a, latency, s) + self.optimizer

    def tail_row(self, a: float, latency: float, s: float, j: int, replicas: int = 1, zero: int = 0) -> np.ndarray:
        """Row ``j`` of ``tail``, without the whole table (``OverlapTables.tail_row``)."""
        if _sharded(a, replicas, zero):
            extra = self.optimizer[j] / replicas + self._exchange(a, latency, replicas)[j]
            return self.overlap.tail_row(*_sync(a, latency, replicas, zero), s, j) + extra
        return self.overlap.tail_row(a, latency, s, j) + self.optimizer[j]

    def tail_column(self, a: float, latency: float, s: float, end: int, replicas: int = 1, zero: int = 0) -> np.ndarray:
        """Column ``end`` of ``tail``, without the whole table (``OverlapTables.tail_column``)."""
        if _sharded(a, replicas, zero):
            extra = self.optimizer[:, end] / replicas + self._exchange(a, latency, replicas)[:, end]
            return self.overlap.tail_column(*_sync(a, latency, replicas, zero), s, end) + extra
        return self.overlap.tail_column(a, latency, s, end) + self.optimizer[:, end]

    def stage_tail(self, a: float, latency: float, s: float, start: int, end: int, replicas: int = 1, zero: int = 0) -> float:
        """``tail`` of the one range [start, end); ``a`` = 0: one replica, no sync."""
        if a <= 0:
            return float(self.optimizer[start, end])
        return float(self.tail(a, latency, s, replicas, zero)[start, end])

    def _exchange(self, a: float, latency: float, replicas: int) -> np.ndarray:
        """``costs.zero_exchange_ms`` of every range's parameters on a ring whose AllReduce
        costs ``a`` per byte (2 (r-1)/r over the ring's bytes per ms) and ``latency`` per
        call: the bytes over the ring's bandwidth plus one call per replica (memoised)."""
        key = (a, latency, replicas)
        found = self._exchanges.get(key)
        if found is None:
            per_byte = a * replicas / (2.0 * (replicas - 1))
            found = self._exchanges[key] = np.where(self.params > 0, self.params * per_byte + replicas * latency, 0.0)
        return found

    def cut_bytes(self, last: Any, scale: float) -> Any:
        """Bytes crossing the cut after layer(s) ``last`` (an index or an index array) for
        ``scale`` x the profile's micro-batch (``model_profile.cut_bytes``)."""
        return cut_bytes(self.output[last], self.output_whole[last], scale)

    def stash_bytes(self, rows: Any, cols: Any, scale: Any) -> Any:
        """Stash of one slice of stage(s) [``rows``, ``cols``) (indices, slices or index
        arrays into the range tables) at ``scale`` x the profile's micro-batch, as
        ``model_profile.stash_span_bytes`` prices it: the per-sample sum scaled, the whole
        sum once (``scale`` may be an array that broadcasts against the cells)."""
        return self.stash[rows, cols] * scale + self.stash_whole[rows, cols]

    @staticmethod
    def _range_sums(values: Sequence[float], first: Sequence[float] | None = None) -> np.ndarray:
        """Sums of ``values`` over every range [a, b), in the order ``sum`` adds them; with
        ``first``, a range starts with ``first[a]`` instead of ``values[a]``."""
        n = len(values)
        starts = values if first is None else first
        table = np.zeros((n + 1, n + 1))
        for a in range(n):
            acc = 0
            row = table[a]
            for b in range(a, n):
                acc = acc + (starts[b] if b == a else values[b])
                row[b + 1] = acc
        return table


def _sharded(a: float, replicas: int, zero: int) -> bool:
    """Whether a stage on a ring with AllReduce cost ``a`` per byte shards under ZeRO."""
    return zero > 0 and replicas > 1 and a > 0


def _sync(a: float, latency: float, replicas: int, zero: int) -> tuple[float, float]:
    """(cost per byte, cost per call) of a gradient bucket's sync: the AllReduce's, or for
    ``zero=2`` the reduce onto the owners (``costs.zero_reduce_ms``: the bytes over the
    ring's bandwidth, one call per replica)."""
    if zero >= 2:
        return a * replicas / (2.0 * (replicas - 1)), replicas * latency
    return a, latency


def p2p_ms_fast(cluster: Cluster, num_bytes: float, senders: Sequence[int], receivers: Sequence[int]) -> float:
    """``Cluster.p2p_ms`` in O(a + b) instead of O(a b): the split-concat pieces (DAPPLE
    5.2.2) are the overlaps of two partitions of [0, 1), found by one sweep in the same
    (sender, receiver) order (``_sweep``), so the sums are accumulated exactly as
    ``p2p_ms`` does. ``tests/test_planner.py`` checks the two agree."""
    if num_bytes <= 0 or not senders or not receivers:
        return 0.0
    per = cluster.devices_per_machine
    # per-machine sums in lists, per-device sums in dictionaries as in p2p_ms; each sum is
    # accumulated over the pieces in the same order as p2p_ms does, so the maxima are equal
    network_out = [0.0] * cluster.machines
    network_in = [0.0] * cluster.machines
    local_out: dict[int, float] = {}
    local_in: dict[int, float] = {}
    for i, j, width in _sweep(len(senders), len(receivers)):
        src, dst = senders[i], receivers[j]
        if src != dst:
            size = width * num_bytes
            ms, md = src // per, dst // per
            if ms != md:
                network_out[ms] += size
                network_in[md] += size
            else:
                local_out[src] = local_out.get(src, 0.0) + size
                local_in[dst] = local_in.get(dst, 0.0) + size
    network = max(max(network_out), max(network_in)) / cluster.bytes_per_ms(cluster.inter_bandwidth_gbps)
    local = max([*local_out.values(), *local_in.values(), 0.0]) / cluster.bytes_per_ms(cluster.intra_bandwidth_gbps)
    if network == 0.0 and local == 0.0:
        return 0.0
    return max(network, local) + cluster.latency_ms


@lru_cache(maxsize=1 << 16)
def _sweep(a: int, b: int) -> tuple[tuple[int, int, float], ...]:
    """The split-concat pieces of ``a`` senders and ``b`` receivers in sweep order, as
    (sender index, receiver index, width as a fraction of the boundary), pieces of width
    1e-12 or less left out; memoised, as they depend on ``a`` and ``b`` alone."""
    found = []
    i = j = 0
    lo = 0.0  # each piece starts where the previous one ended
    end_i, end_j = 1 / a, 1 / b
    while True:
        hi = end_i if end_i <= end_j else end_j
        if hi > lo + 1e-12:
            found.append((i, j, hi - lo))
        lo = hi
        advance_j = end_j <= end_i
        if end_i <= end_j:
            i += 1
            if i == a:
                break
            end_i = (i + 1) / a
        if advance_j:
            j += 1
            if j == b:
                break
            end_j = (j + 1) / b
    return tuple(found)
