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
        # [j, J] -> the flat index of (J, count[j, J]) in a per-end (n + 1) x (width + 1) array
        self._flat = np.arange(n + 1)[None, :] * (width + 1) + self.count
        self._low_backward = self.backward[np.maximum(self.low[:, 1:], 0)]  # W(0, lo_k) of bucket k of [0, J)
        self._done_cache: dict[tuple[float, float], np.ndarray] = {}
        self._left_positive = self.left_bytes > 0
        self._upper = np.arange(n + 1)[None, :] > np.arange(n + 1)[:, None]  # [j, J]: J > j
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
            done, best = self._per_end(a, latency, s, slice(None))
            found = self._finish(a, latency, s, done.ravel().take(self._flat), best.ravel().take(self._flat), self.backward[:, None], self.left_bytes, self._left_positive)
            found = np.where(self._upper, found, 0.0)
        self._cache[key] = found
        return found

    def tail_row(self, a: float, latency: float, s: float, j: int) -> np.ndarray:
        """Row ``j`` of ``tail`` (ranges [j, J) for every J), equal to it element for element
        (the same operations on each element), without the whole table when that is not
        there yet."""
        found = self._cache.get((a, latency, s))
        if found is not None:
            return found[j]
        if a <= 0:
            return np.zeros(self.n + 1)
        done, best = self._per_end(a, latency, s, slice(None))
        flat = self._flat[j]
        found = self._finish(a, latency, s, done.ravel().take(flat), best.ravel().take(flat), self.backward[j], self.left_bytes[j], self._left_positive[j])
        return np.where(np.arange(self.n + 1) > j, found, 0.0)

    def tail_column(self, a: float, latency: float, s: float, end: int) -> np.ndarray:
        """Column ``end`` of ``tail`` (ranges [j, end) for every j), as ``tail_row``; only
        the buckets of [0, end) are priced."""
        found = self._cache.get((a, latency, s))
        if found is not None:
            return found[:, end]
        if a <= 0:
            return np.zeros(self.n + 1)
        done, best = self._per_end(a, latency, s, slice(end, end + 1))
        count = self.count[:, end]
        found = self._finish(a, latency, s, done[0].take(count), best[0].take(count), self.backward, self.left_bytes[:, end], self._left_positive[:, end])
        return np.where(end > np.arange(self.n + 1), found, 0.0)

    def _per_end(self, a: float, latency: float, s: float, ends: slice) -> tuple[np.ndarray, np.ndarray]:
        """For the ends J in ``ends`` (all, or the one a column needs): ``done[J, c]`` = D_c
        and ``best[J, c]`` = the largest ``-D_{k-1} - s W(0, lo_k)`` over the buckets k <= c,
        from which every start j's tail is read off (module docstring)."""
        done = self._done(a, latency)[ends]
        ready = -done[:, :-1] - s * self._low_backward[ends]
        ready = np.where(self.valid[ends], ready, -np.inf)
        best = np.concatenate([np.full((done.shape[0], 1), -np.inf), np.maximum.accumulate(ready, axis=1)], axis=1)
        return done, best

    def _done(self, a: float, latency: float) -> np.ndarray:
        """``done[J, c]`` = D_c for every end J: the same for every slice size, so memoised
        by ring (every micro-batch count prices the same rings)."""
        found = self._done_cache.get((a, latency))
        if found is None:
            n = self.n
            duration = np.where(self.valid, a * self.bucket_bytes + latency, 0.0)
            found = self._done_cache[(a, latency)] = np.concatenate([np.zeros((n + 1, 1)), np.cumsum(duration, axis=1)], axis=1)
        return found

    @staticmethod
    def _finish(a: float, latency: float, s: float, done: np.ndarray, best: np.ndarray, backward: np.ndarray | float, left_bytes: np.ndarray, left_positive: np.ndarray) -> np.ndarray:
        """The tails from the last complete bucket's ``done`` and ``best`` of each range, the
        backward sum before its start and its left-over bucket's bytes (and where they are
        positive)."""
        finish = done + s * backward + best
        left = np.where(left_positive, a * left_bytes + latency, 0.0)
        return left + np.maximum(finish, 0.0)
