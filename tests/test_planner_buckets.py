"""Gradient buckets shared by executor and cost model (DDP-style, reverse layer order)."""
from __future__ import annotations

import pytest

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.buckets import BUCKET_BYTES, bucket_layers


def test_default_is_ddp_bucket_cap() -> None:
    assert BUCKET_BYTES == 25 * 2**20


def test_buckets_fill_from_the_back_in_launch_order() -> None:
    sizes = [4, 1, 1, 3, 0, 2, 2]
    assert bucket_layers(sizes, 0, 7, bucket_bytes=4) == [(5, 7), (2, 5), (0, 2)]
    # a sub-range: only its own layers
    assert bucket_layers(sizes, 1, 4, bucket_bytes=4) == [(2, 4), (1, 2)]
    # a layer larger than the bucket stays whole and closes its bucket
    assert bucket_layers([10, 1, 1], 0, 3, bucket_bytes=2) == [(1, 3), (0, 1)]


def test_buckets_cover_the_range_exactly_once() -> None:
    sizes = [3, 0, 7, 1, 1, 1, 9, 0, 2]
    for bucket in (1, 2, 5, 100):
        ranges = bucket_layers(sizes, 2, 9, bucket_bytes=bucket)
        covered = [layer for lo, hi in reversed(ranges) for layer in range(lo, hi)]
        assert covered == list(range(2, 9))
        assert all(hi > lo for lo, hi in ranges)
        # every bucket but the last (the front layers) holds at least bucket bytes
        assert all(sum(sizes[lo:hi]) >= bucket for lo, hi in ranges[:-1])
    assert bucket_layers(sizes, 4, 4) == []


def test_bad_ranges_are_errors() -> None:
    with pytest.raises(DappleConfigError):
        bucket_layers([1, 2], 0, 3)
    with pytest.raises(DappleConfigError):
        bucket_layers([1, 2], 0, 2, bucket_bytes=0)
