"""Measure the run's own links: an AllReduce's fixed cost and bandwidth, a transfer's latency.

DAPPLE prices a replicated stage's gradient sync as AR(P_s, g_s), a ring AllReduce over
the stage's devices (sec. 4.1), from the cluster's link speed. A detected cluster only
assumes its links (``cluster.GPU_LINKS`` / ``CPU_LINKS``), and with no cost per call a
small model's sync looks free: on CPU processes a gloo AllReduce of a few kilobytes
takes from a few tenths of a millisecond to several milliseconds, which the assumed
40 Gbit/s and zero latency price at almost nothing, so data parallelism looks cheaper than
it runs.

``measure_links`` runs on the run's own processes, after the process group exists and
before rank 0 plans:

* AllReduces of two sizes over every rank, fitted to the ring model
  ``Cluster.allreduce_ms``: time = latency(w) + 2 (w - 1) / w x bytes / bandwidth, and a
  small one over ranks 0 and 1 alone: latency(2). The fixed cost grows with the ring (each
  of its 2 (w - 1) steps waits for the slowest process), so it is kept as latency(2) and a
  cost per rank beyond 2, the line through the two;
* a ping-pong of a small message between ranks 2k and 2k + 1, all pairs at once
  (split-concat transfers, DAPPLE 5.2.2, are point to point, and a pipeline's stages move
  their boundaries at the same time): half the slowest round trip is one transfer's
  latency. Where processes outnumber cores, these are mostly the time a message waits for
  its receiver to get a core: a ``vgg_tiny`` run on 4 CPU processes sharing 2 cores
  recorded (its plan's ``extra.cluster``) 0.70 ms for an AllReduce over 2 ranks and 2.70 ms
  more per rank beyond (6.1 ms over 4), and 0.20 ms per transfer. Each exchange starts
  after a barrier, so this is a lower bound for a running pipeline whose processes drift
  apart. The shared-core bound (``simulate/cores.py``) prices the compute taking turns;
  these price the waits a plan's transfers and AllReduces add.

Each time is the median over ``repeats`` calls (each after a barrier), the slowest rank's.
``with_measured_links`` puts the result into a detected cluster: ``allreduce_latency_ms``,
``allreduce_latency_per_rank_ms`` and ``latency_ms`` always, the intra-machine bandwidth
when all ranks are on one machine (a ring over several machines is paced by the slower
inter-machine links, which this does not measure apart).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from lightning_dapple.cluster import Cluster
from lightning_dapple.execute.process_groups import subgroup
from lightning_dapple.profile.profiler import timed_ms

__all__ = ["LinkFit", "fit_ring", "measure_links", "with_measured_links"]

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 4 * 1024 * 1024


class LinkFit(NamedTuple):
    """The ring model's fixed cost per AllReduce (of 2 devices, and per device beyond 2) and
    its bandwidth (None where the two sizes gave no slope), and one transfer's latency."""

    latency_ms: float
    bandwidth_gbps: float | None
    per_rank_ms: float = 0.0
    transfer_ms: float = 0.0


def fit_ring(small_ms: float, large_ms: float, world: int, small_bytes: int = SMALL_BYTES, large_bytes: int = LARGE_BYTES) -> LinkFit:
    """The ring model's (latency, bandwidth) through two measured AllReduce times."""
    coefficient = 2.0 * (world - 1) / world
    slope = (large_ms - small_ms) / (large_bytes - small_bytes)  # ms per byte of payload
    latency = max(small_ms - max(slope, 0.0) * small_bytes, 0.0)
    if slope <= 0:
        return LinkFit(latency, None)
    bytes_per_ms = coefficient / slope
    return LinkFit(latency, bytes_per_ms * 8 * 1e3 / 1e9)


def _after_barriers_ms(device: torch.device, call: Callable[[], Any], repeats: int, warmup: int) -> list[float]:
    """This rank's ms for each of ``repeats`` calls after ``warmup``, each after a barrier."""
    times = []
    for index in range(warmup + repeats):
        dist.barrier()
        elapsed, _ = timed_ms(device, call)
        if index >= warmup:
            times.append(elapsed)
    return times


def _allreduce(size_bytes: int, device: torch.device) -> Callable[[], Any]:
    buffer = torch.zeros(max(size_bytes // 4, 1), dtype=torch.float32, device=device)
    return lambda: dist.all_reduce(buffer)


def _ping_pong(rank: int, world: int, device: torch.device) -> Callable[[], Any]:
    """Ranks 2k and 2k + 1 send a small message there and back, every pair at once (a
    pipeline's stages all move boundaries at the same time); a last odd rank waits."""
    buffer = torch.zeros(256, dtype=torch.float32, device=device)
    peer = rank ^ 1

    def call() -> None:
        if peer >= world:
            return
        if rank % 2 == 0:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)

    return call


def measure_links(device: torch.device, repeats: int = 7, warmup: int = 2) -> LinkFit:
    """The fitted AllReduce and the one-way transfer latency of this process group (module
    docstring); a collective: every rank calls it and gets the same answer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = subgroup([0, 1]) if world > 2 else None
    pair_buffer = torch.zeros(SMALL_BYTES // 4, dtype=torch.float32, device=device)

    def pair_allreduce() -> None:
        if rank < 2:
            dist.all_reduce(pair_buffer, group=pair)

    rows = [
        _after_barriers_ms(device, _allreduce(SMALL_BYTES, device), repeats, warmup),
        _after_barriers_ms(device, _allreduce(LARGE_BYTES, device), repeats, warmup),
        _after_barriers_ms(device, _ping_pong(rank, world, device), repeats, warmup),
        _after_barriers_ms(device, pair_allreduce, repeats, warmup) if pair is not None else [0.0] * repeats,
    ]
    slowest = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if pair is not None:
        dist.destroy_process_group(pair)
    small, large, round_trip, pair_small = (statistics.median(row) for row in slowest.tolist())
    fit = fit_ring(small, large, world)
    if pair is None:
        return fit._replace(transfer_ms=round_trip / 2)
    payload = SMALL_BYTES / (fit.bandwidth_gbps * 1e9 / 8 / 1e3) if fit.bandwidth_gbps else 0.0  # 2 (w-1)/w = 1 at w = 2
    two = max(pair_small - payload, 0.0)
    return fit._replace(latency_ms=two, per_rank_ms=max(fit.latency_ms - two, 0.0) / (world - 2), transfer_ms=round_trip / 2)


def with_measured_links(cluster: Cluster, device: torch.device) -> Cluster:
    """``cluster`` with its AllReduce as measured on this process group (module docstring);
    unchanged without a group of two or more ranks. A collective."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return cluster
    # gloo moves host memory (ranks sharing a GPU run it; their stage boundaries are staged
    # through the host, ``execute/transfer/wires.py``), NCCL device memory
    fit = measure_links(device if dist.get_backend() == "nccl" else torch.device("cpu"))
    out = replace(
        cluster,
        allreduce_latency_ms=round(fit.latency_ms, 4),
        allreduce_latency_per_rank_ms=round(fit.per_rank_ms, 4),
        latency_ms=round(fit.transfer_ms, 4),
    )
    if cluster.machines == 1 and fit.bandwidth_gbps is not None:
        out = replace(out, intra_bandwidth_gbps=round(fit.bandwidth_gbps, 3))
    return out
