"""How fast any plan of one shape could step: a lower bound over every cut and every M.

DAPPLE's Table 4 (6.2) names a plan by its shape -- data parallelism ("DP"), the straight
pipeline (one device per stage) or two stages replicated P and Q ways ("P:Q"). Simulating
the best plans of a shape shows how fast those plans are; this module shows how fast *no*
plan of the shape can be, whatever its layer cuts, micro-batch count M or warm-up counts
K_i. When the bound lies above another plan's simulated step, the cost model itself rules
the shape out: no change to the search or the re-ranking can make the planner choose it.

The bound per stage s of a plan (``synced_step_lower_bound``) extends
``costs.step_lower_bound``: the stage cannot start before the first micro-batch's forward has
crossed the stages and links before it, it then runs M forwards and M backwards, and its
gradient buckets (``StageCost.allreduce_buckets``) still run their exposed tail after the
last backward (4.1's AR(P_s, g_s), overlapped as DDP overlaps it). This holds for the
schedules the planner compares shapes under -- DAPPLE's early backward with any K_i (5.3)
and GPipe -- but not under out-of-order backprop, whose reordered weight gradients can start
a bucket earlier (ooo-backprop 5.1). Memory is ignored: plans that do not fit only raise
the true minimum.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from lightning_dapple.errors import require
from lightning_dapple.plan.costs import StageCost, stage_costs, step_lower_bound
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.request import PlanRequest

__all__ = ["shape_lower_bound", "synced_step_lower_bound"]

_INF = float("inf")


def synced_step_lower_bound(costs: Sequence[StageCost], micro_batches: int) -> float:
    """``costs.step_lower_bound``, and for every stage the forward path before it, its M
    forwards and backwards and its tail (exposed AllReduce and optimizer step, module docstring)."""
    best = step_lower_bound(costs, micro_batches)
    forward_path = 0.0
    for cost in costs:
        best = max(best, forward_path + micro_batches * (cost.forward_ms + cost.backward_ms) + cost.tail_ms)
        forward_path += cost.forward_ms + cost.send_ms
    return best


def shape_lower_bound(request: PlanRequest, shape: str) -> tuple[float, int] | None:
    """(ms, M) of the smallest ``synced_step_lower_bound`` over the plans of ``shape`` that
    ``request`` allows (every M candidate whose slices respect the floor, every cut), or
    None when the shape has no such plan (too few devices, or slices below the floor).
    ``shape`` is "DP", "straight" or "P:Q" (the first stage on ranks 0..P-1, the second on
    the next Q, as the Table 4 comparison places them)."""
    if shape == "DP":
        return _best(_stages_bound(request, [[(0, request.profile.num_layers)]], (request.cluster.num_devices,)))
    if shape == "straight":
        return _best(_straight_bound(request, m) for m in request.micro_batches)
    parts = shape.split(":")
    require(
        len(parts) == 2 and all(part.isdigit() and int(part) > 0 for part in parts),
        "shape",
        f"is {shape!r}",
        "use 'DP', 'straight' or two replica counts 'P:Q' such as '8:8'",
    )
    n = request.profile.num_layers
    cuts = [[(0, cut), (cut, n)] for cut in range(1, n)]
    return _best(_stages_bound(request, cuts, (int(parts[0]), int(parts[1]))))


def _best(found: Iterable[tuple[float, int] | None]) -> tuple[float, int] | None:
    valid = [item for item in found if item is not None]
    return min(valid) if valid else None


def _stages_bound(request: PlanRequest, layouts: list[list[tuple[int, int]]], replicas: tuple[int, ...]) -> list[tuple[float, int] | None]:
    """The bound of every layout (layer ranges per stage, stage i on the next ``replicas[i]``
    ranks) at every M whose slices respect the floor."""
    if sum(replicas) > request.cluster.num_devices:
        return []
    firsts = np.cumsum((0, *replicas))
    devices = [tuple(range(int(firsts[i]), int(firsts[i + 1]))) for i in range(len(replicas))]
    out: list[tuple[float, int] | None] = []
    for m in request.micro_batches:
        mbs = request.global_batch_size // m
        if max(replicas) > min(mbs // request.floor, mbs):
            continue
        for layout in layouts:
            stages = tuple(StagePlan(layers, ranks) for layers, ranks in zip(layout, devices))
            costs = stage_costs(request.profile, request.cluster, stages, mbs)
            out.append((synced_step_lower_bound(costs, m), m))
    return out


def _straight_bound(request: PlanRequest, m: int) -> tuple[float, int] | None:
    """The bound over every cut of the straight pipeline at M = ``m``, by a bottleneck DP over
    cut positions. No stage is replicated, so nothing is all-reduced: stage s = [a, b) cannot
    end its step before the forward work of the layers before it, M times its own forwards
    and backwards, and the input gradient's way back through the layers before it, plus the
    s transfers each way between them (``step_lower_bound``'s paths). Those transfers depend
    on the earlier cuts; each is priced at least as the cheapest link, and together at least
    as the one at ``a`` plus the s - 1 smallest at cuts before ``a`` (``_path_transfers``)."""
    profile, cluster, g = request.profile, request.cluster, request.cluster.num_devices
    n, mbs = profile.num_layers, request.global_batch_size // m
    if mbs < request.floor or n < g:
        return None
    scale = profile.scale(mbs)
    layers = profile.layers
    forward, work = request.tables.forward[0] * scale, request.tables.work[0] * scale  # sums of layers [0, a)
    back = np.concatenate(([0.0], np.cumsum([min(layer.input_grad_ms, layer.backward_ms) for layer in layers]))) * scale
    probe = 1e6  # p2p_ms is affine in the bytes for a fixed pair of ranks
    cheapest = min((cluster.p2p_ms(probe, (t - 1,), (t,)), cluster.p2p_ms(2 * probe, (t - 1,), (t,))) for t in range(1, g))
    per_byte, latency = (cheapest[1] - cheapest[0]) / probe, 2 * cheapest[0] - cheapest[1]
    # transfer[c]: the cut before layer c (no stage starts at 0's left or after the last layer)
    transfer = np.array([0.0] + [layer.cut_bytes(scale) * per_byte + latency for layer in layers[:-1]] + [_INF])
    paths = _path_transfers(transfer, g)
    starts = np.arange(n + 1)
    is_stage = starts[:, None] < starts[None, :]
    best = np.full(n + 1, _INF)
    best[0] = 0.0
    for s in range(g):
        # own[a, b]: the bound of stage s = [a, b)
        own = (forward + back + 2.0 * paths[s])[:, None] + m * (work[None, :] - work[:, None])
        best = np.min(np.maximum(best[:, None], np.where(is_stage, own, _INF)), axis=0)
    return (float(best[n]), m) if best[n] < _INF else None


def _path_transfers(transfer: np.ndarray, stages: int) -> np.ndarray:
    """``paths[s, a]``: a lower bound on the s transfers between stage 0 and a stage s that
    starts at layer ``a`` -- the transfer at cut ``a`` plus the s - 1 cheapest at cuts
    1 .. a-1 (``transfer[c]`` prices the cut before layer c); infinite where s stages do not
    fit before ``a``."""
    n = transfer.size - 1
    paths = np.full((stages, n + 1), _INF)
    paths[0, 0] = 0.0
    for a in range(1, n + 1):
        cheapest = np.concatenate(([0.0], np.cumsum(np.sort(transfer[1:a]))))
        for s in range(1, min(stages, a + 1)):
            paths[s, a] = transfer[a] + cheapest[s - 1]
    return paths
