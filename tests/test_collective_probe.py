"""The run's own AllReduce, measured before planning, and what it changes in the cost model."""
from __future__ import annotations

import pytest
import torch

from lightning_dapple.cluster import Cluster, cluster_from_dict
from lightning_dapple.execute.collective_probe import LARGE_BYTES, SMALL_BYTES, fit_ring, with_measured_links

from dist_harness import run_ranks


@pytest.mark.parametrize("world", [2, 4, 8])
def test_the_fit_reproduces_both_measured_times_through_the_ring_model(world: int) -> None:
    fit = fit_ring(0.8, 3.3, world)
    cluster = Cluster(1, world, intra_bandwidth_gbps=fit.bandwidth_gbps, allreduce_latency_ms=fit.latency_ms, latency_ms=5.0)
    ranks = list(range(world))
    assert cluster.allreduce_ms(SMALL_BYTES, ranks) == pytest.approx(0.8)
    assert cluster.allreduce_ms(LARGE_BYTES, ranks) == pytest.approx(3.3)


def test_no_slope_keeps_the_assumed_bandwidth() -> None:
    fit = fit_ring(1.2, 1.1, 4)  # noise: the large one measured faster
    assert fit.bandwidth_gbps is None and fit.latency_ms == pytest.approx(1.2)


def _measured(rank: int, world: int) -> dict:
    assumed = Cluster(1, world, intra_bandwidth_gbps=40.0, latency_ms=0.0)
    out = with_measured_links(assumed, torch.device("cpu"))
    return out.to_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_measured_cluster(world: int) -> None:
    results = run_ranks(_measured, world, timeout_s=120, raise_on_error=True)
    assert all(results[rank] == results[0] for rank in range(world))  # the slowest rank's medians, shared by all
    measured = cluster_from_dict(results[0])
    # a gloo AllReduce and a message between two processes cost something per call, which
    # the assumed cluster priced at nothing
    assert measured.allreduce_latency_ms > 0 and measured.latency_ms > 0
    assert measured.allreduce_latency_per_rank_ms >= 0
    assumed = Cluster(1, world, intra_bandwidth_gbps=40.0)
    assert measured.allreduce_ms(SMALL_BYTES, [0, 1]) > assumed.allreduce_ms(SMALL_BYTES, [0, 1])
    assert measured.p2p_ms(SMALL_BYTES, [0], [1]) > assumed.p2p_ms(SMALL_BYTES, [0], [1])


def test_allreduce_and_transfer_latencies_are_priced_apart() -> None:
    cluster = Cluster(1, 2, intra_bandwidth_gbps=40.0, latency_ms=0.25, allreduce_latency_ms=6.0)
    bytes_ms = SMALL_BYTES / cluster.bytes_per_ms(40.0)
    assert cluster.p2p_ms(SMALL_BYTES, [0], [1]) == pytest.approx(bytes_ms + 0.25)
    assert cluster.allreduce_ms(SMALL_BYTES, [0, 1]) == pytest.approx(bytes_ms + 6.0)  # 2 (w-1)/w = 1 for w = 2
    assert Cluster(1, 2, latency_ms=0.25).ring_latency_ms(2) == 0.25  # no AllReduce latency of its own: latency_ms
    wide = Cluster(1, 4, intra_bandwidth_gbps=40.0, latency_ms=0.25, allreduce_latency_ms=0.5, allreduce_latency_per_rank_ms=2.0)
    payload = SMALL_BYTES / wide.bytes_per_ms(40.0)
    assert wide.allreduce_ms(SMALL_BYTES, [0, 1]) == pytest.approx(0.5 + payload)
    assert wide.allreduce_ms(SMALL_BYTES, [0, 1, 2, 3]) == pytest.approx(4.5 + 1.5 * payload)


def test_one_process_leaves_the_cluster_as_it_is() -> None:
    cluster = Cluster(1, 1, intra_bandwidth_gbps=40.0)
    assert with_measured_links(cluster, torch.device("cpu")) is cluster
