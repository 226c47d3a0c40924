"""How many NCCL communicators each rank of a plan creates, and the device memory they take.

Every process group the executor makes over NCCL is a communicator on each of its members,
and each communicator reserves device memory of its own (buffers per peer and channel):
NVIDIA/nccl#964 measured about 544 MB per two-GPU communicator on A100 with NCCL's
default settings (``NCCL_COMMUNICATOR_BYTES``). A DAPPLE plan (sec. 4) makes several per
rank, so a plan that fits by weights and activations alone (5.3) can still run out of
memory; ``communicator_memory`` prices them for the memory model, where the run uses NCCL
(``communicator_reserve_bytes``: 0 on CPU processes and gloo groups).

The groups, exactly as the executor makes them (``execute/groups.py``, ``execute/tied.py``,
``execute/transfer/wires.py``, ``execute/transfer/links.py``), each counted on its members only (under NCCL a
subgroup is split from the default communicator; ranks outside it get none):

* ``default``: the job's default group, on every rank of the world;
* ``plan``: one group of the plan's ranks, where the plan does not use the whole world;
* ``replicas``: one per distinct device list of a replicated stage (chunks of one device
  group share it): the gradient AllReduce of DAPPLE 5.2.3, ZeRO's exchange, BatchNorm sync;
* ``tied``: one per distinct set of ranks holding a parameter tied across stages;
* ``link`` (the ``nccl`` wire only): a two-rank group per direction (activation, gradient)
  for every pair of ranks of adjacent stages whose slices of a micro-batch overlap
  (split-concat, DAPPLE 5.2.2: replica i of r and j of r' share rows when
  [i/r, (i+1)/r) and [j/r', (j+1)/r') overlap); a plan whose ranks hold several stages
  (interleaved, V) gets one per boundary, pair and direction instead (a stream), and a
  boundary between two stages on the same devices is a hand-off in process.

Groups made only for a moment (the link probe of ``execute/collective_probe.py``, destroyed
before the plan exists) and gloo groups (checkpoint writers, the part stream) hold no NCCL
communicator and are not counted.

``communicator_cap`` states an upper bound from the plan's shape alone: a replica of a
stage with r replicas shares rows with at most ceil(r'/r) + 1 of the r' replicas of a
neighbouring stage, so it makes at most that many link pairs (two groups each) per
boundary it touches.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_dapple.plan.costs import stages_holding
from lightning_dapple.plan.plan import Plan

__all__ = [
    "NCCL_COMMUNICATOR_BYTES",
    "communicator_cap",
    "communicator_groups",
    "communicator_memory",
    "communicator_reserve_bytes",
    "communicators_per_rank",
]

#: Device memory one NCCL communicator reserves: about 544 MB per two-GPU communicator on
#: A100 with NCCL's default settings, as measured in NVIDIA/nccl#964 ("NCCL uses a lot
#: of GPU memory per communicator"). It varies with the GPU, the NCCL version and settings
#: such as NCCL_BUFFSIZE and NCCL_NCHANNELS; a stated estimate, not a measurement of this run.
NCCL_COMMUNICATOR_BYTES = 544e6

Group = tuple[str, tuple[int, ...]]  # (kind, member ranks)


def _layers_of(tie: Any) -> Sequence[int]:
    """A tie's layer indices: its ``layers`` (``TiedParams``, ``TiedParameter``) or itself."""
    return tuple(getattr(tie, "layers", tie))


def _can_share(index: int, count: int, other: int, other_count: int) -> bool:
    """Whether replica ``index`` of ``count`` and ``other`` of ``other_count`` can hold a
    common row of some micro-batch (their fractions of it overlap, module docstring)."""
    return index * other_count < (other + 1) * count and other * count < (index + 1) * other_count


def _link_groups(plan: Plan) -> list[Group]:
    """Two groups (activation, gradient) per link, or per stream where ranks hold several
    stages, in the executor's order (``wires.link_groups``: sorted by the pair's ranks)."""
    chunked = plan.chunks > 1
    keys: set[tuple[int, int, int]] = set()
    for boundary, (upstream, downstream) in enumerate(zip(plan.stages, plan.stages[1:])):
        for i, sender in enumerate(upstream.devices):
            for j, receiver in enumerate(downstream.devices):
                if sender != receiver and _can_share(i, upstream.replicas, j, downstream.replicas):
                    keys.add((min(sender, receiver), max(sender, receiver), boundary if chunked else -1))
    return [(f"link {direction}", (low, high)) for low, high, _ in sorted(keys) for direction in ("activation", "gradient")]


def communicator_groups(plan: Plan, ties: Sequence[Any] = (), world_size: int | None = None, wire: str = "nccl") -> list[Group]:
    """Every process group the executor makes for ``plan`` (module docstring), as (kind,
    member ranks). ``ties``: the model's tied parameters (``ModelProfile.tied``,
    ``profile.ties.TiedParameter``, or tuples of layer indices); ``world_size``: the job's
    (default: the plan's); ``wire``: the stage boundaries' wire, whose ``nccl`` alone makes
    link groups (``execute/transfer/wires.py``)."""
    world = plan.world_size if world_size is None else world_size
    groups: list[Group] = [("default", tuple(range(world)))]
    ranks = tuple(sorted({rank for stage in plan.stages for rank in stage.devices}))
    if len(ranks) != world:
        groups.append(("plan", ranks))
    replicated = [stage.devices for stage in plan.stages if stage.replicas > 1]
    groups += [("replicas", tuple(sorted(devices))) for devices in dict.fromkeys(replicated)]
    tied: list[tuple[int, ...]] = []
    for tie in ties:
        holders = stages_holding(_layers_of(tie), plan.stages)
        if len(holders) > 1:
            tied.append(tuple(sorted({rank for s in holders for rank in plan.stages[s].devices})))
    groups += [("tied", members) for members in dict.fromkeys(tied)]
    if wire == "nccl":
        groups += _link_groups(plan)
    return groups


def communicators_per_rank(plan: Plan, ties: Sequence[Any] = (), world_size: int | None = None, wire: str = "nccl") -> dict[int, int]:
    """How many communicators each rank of the job belongs to (``communicator_groups``)."""
    world = plan.world_size if world_size is None else world_size
    counts = dict.fromkeys(range(world), 0)
    for _, members in communicator_groups(plan, ties, world_size, wire):
        for rank in members:
            counts[rank] += 1
    return counts


def communicator_cap(plan: Plan, ties: Sequence[Any] = (), world_size: int | None = None) -> dict[int, int]:
    """An upper bound on ``communicators_per_rank`` from the shape alone (module docstring):
    the default and plan groups, a replica group where a stage of the rank is replicated,
    every tie, and two groups for each of the at most ceil(r'/r) + 1 peers per boundary the
    rank's stages touch (r the own replica count, r' the neighbour's)."""
    world = plan.world_size if world_size is None else world_size
    cap = dict.fromkeys(range(world), 1)
    ranks = {rank for stage in plan.stages for rank in stage.devices}
    replicated = {rank for stage in plan.stages if stage.replicas > 1 for rank in stage.devices}
    for rank in ranks:
        cap[rank] += (1 if len(ranks) != world else 0) + (1 if rank in replicated else 0) + len(ties)
    for index, stage in enumerate(plan.stages):
        for neighbour in (index - 1, index + 1):
            if 0 <= neighbour < plan.num_stages and plan.stages[neighbour].devices != stage.devices:
                peers = math.ceil(plan.stages[neighbour].replicas / stage.replicas) + 1
                for rank in stage.devices:
                    cap[rank] += 2 * peers
    return cap


def communicator_reserve_bytes(device_type: str, backend: str | None = "nccl") -> float:
    """Device memory per communicator for the memory model: ``NCCL_COMMUNICATOR_BYTES`` where
    the run's groups are NCCL communicators on GPUs, 0 elsewhere (CPU processes, gloo)."""
    return NCCL_COMMUNICATOR_BYTES if device_type == "cuda" and backend == "nccl" else 0.0


def communicator_memory(plan: Plan, reserve_bytes: float, ties: Sequence[Any] = (), world_size: int | None = None) -> list[float]:
    """Per stage, the communicators' reserve on its most burdened device (count x
    ``reserve_bytes``; 0 everywhere when ``reserve_bytes`` is 0)."""
    if reserve_bytes <= 0:
        return [0.0] * plan.num_stages
    counts = communicators_per_rank(plan, ties, world_size)
    return [max(counts[rank] for rank in stage.devices) * reserve_bytes for stage in plan.stages]
