"""The exposed AllReduce tail of every layer range at once, for the planners' searches.

``costs.exposed_tail`` prices one stage: the gradient buckets of ``buckets.bucket_layers``
start when the last micro-batch's backward has passed their layers and share one link,
so only the tail after the backward counts (DDP-style overlap, DAPPLE 6.3 "DP Overlap").
A search asks for that tail for thousands of (first layer j, end J, ring, slice) at once,
so this module computes it for all ``j < J`` in a few array operations.

Buckets are filled from the back, so the complete buckets of ``[j, J)`` are those of
``[0, J)`` whose low end is at least ``j``, plus a left-over bucket ``[j, lo_c)``. With
bucket k's AllReduce ``d_k = a * bytes_k + latency`` (``a`` = 2 (r-1)/r / bandwidth), its
ready time ``-s W(j, lo_k)`` before the backward's end (``s`` the slice's share of the
profile batch, ``W`` the backward sums) and ``D_c = d_1 + ... + d_c``, the last complete
bucket ends at ``max_k (D_c - D_{k-1} - s W(j, lo_k))`` and the tail is that (if positive)
plus the left-over bucket's own time.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lightning_dapple.plan.buckets import BUCKET_BYTES, bucket_layers

__all__ = ["OverlapTables"]


class OverlapTables:
    """Bucket structure of one profile (all ``[j, J)`` ranges), and per-ring tail tables.

    ``tail(a, latency, s)`` is an ``(n + 1) x (n + 1)`` array whose ``[j, J]`` entry is the
    exposed tail of a stage of layers ``[j, J)`` replicated on a ring with time per byte
    ``a`` and per-call ``latency``, running slices of ``s`` x the profile batch.
    """

    def __init__(self, param_bytes: Sequence[float], backward_ms: Sequence[float], bucket_bytes: int = BUCKET_BYTES) -> None:
        n = len(param_bytes)
        self.n = n
        self.params = np.concatenate([[0.0], np.cumsum(np.asarray(param_bytes, dtype=float))])
        self.backward = np.concatenate([[0.0], np.cumsum(np.asarray(backward_ms, dtype=float))])
        lows = [[lo for lo, _ in bucket_layers(param_bytes, 0, end, bucket_bytes)] for end in range(n + 1)]
        # complete buckets of [0, J): all but the one that reaches layer 0 (unless it ends full)
        complete = [self._complete(param_bytes, end, lo, bucket_bytes) for end, lo in enumerate(lows)]
        width = max((len(c) for c in complete), default=0)
        self.width = width
        self.low = np.full((n + 1, width + 1), -1, dtype=int)  # low[J, k]: low end of bucket k (k >= 1), low[J, 0] = J
        self.low[:, 0] = np.arange(n + 1)
        for end, lows_j in enumerate(complete):
            self.low[end, 1 : len(lows_j) + 1] = lows_j
        high = np.concatenate([self.low[:, :1], self.low[:, :-1]], axis=1)
        valid = self.low[:, 1:] >= 0
        self.bucket_bytes = np.where(valid, self.params[high[:, 1:]] - self.params[np.maximum(self.low[:, 1:], 0)], 0.0)
        self.valid = valid
        # count[j, J]: complete buckets of [0, J) lying inside [j, J) (their low ends >= j)
        self.count = np.zeros((n + 1, n + 1), dtype=int)
        rows = np.arange(n + 1)
        for end, lows_j in enumerate(complete):
            ascending = np.asarray(lows_j[::-1], dtype=int)
            self.count[:, end] = len(lows_j) - np.searchsorted(ascending, rows, side="left")
        left_hi = np.take_along_axis(self.low, self.count.T, axis=1).T  # low end of the last complete bucket, or J
        self.left_bytes = self.params[np.maximum(left_hi, 0)] - self.params[np.arange(n + 1)][:, None]
        self._cache: dict[tuple[float, float, float], np.ndarray] = {}

    @staticmethod
    def _complete(param_bytes: Sequence[float], end: int, lows: list[int], bucket_bytes: int) -> list[int]:
        """Low ends of the buckets of [0, end) that closed full (the front one may not have)."""
        out = []
        for k, lo in enumerate(lows):
            hi = end if k == 0 else lows[k - 1]
            if sum(param_bytes[lo:hi]) >= bucket_bytes:
                out.append(lo)
        return out

    def tail(self, a: float, latency: float, s: float) -> np.ndarray:
        """Exposed AllReduce tail of every range ``[j, J)`` (rows j, columns J); ``a`` = 0
        means one replica (no sync)."""
        key = (a, latency, s)
        found = self._cache.get(key)
        if found is not None:
            return found
        n = self.n
        if a <= 0:
            found = np.zeros((n + 1, n + 1))
        else:
            duration = np.where(self.valid, a * self.bucket_bytes + latency, 0.0)
            done = np.concatenate([np.zeros((n + 1, 1)), np.cumsum(duration, axis=1)], axis=1)  # D[J, c]
            ready = -done[:, :-1] - s * self.backward[np.maximum(self.low[:, 1:], 0)]
            ready = np.where(self.valid, ready, -np.inf)
            best = np.concatenate([np.full((n + 1, 1), -np.inf), np.maximum.accumulate(ready, axis=1)], axis=1)
            columns = np.arange(n + 1)[None, :]
            count = self.count
            finish = done[columns, count] + s * self.backward[:, None] + best[columns, count]
            left = np.where(self.left_bytes > 0, a * self.left_bytes + latency, 0.0)
            found = left + np.maximum(finish, 0.0)
            found = np.where(columns > np.arange(n + 1)[:, None], found, 0.0)
        self._cache[key] = found
        return found
