"""The machines a job was launched on: nodes x processes per node, and each rank's node.

DAPPLE plans for a hierarchical cluster (Table 2: devices on one machine share a fast
link, machines a slower one) and places stages by machine (Section 4.2), so the planner's
``Cluster`` must be the launch's shape, and a plan's stages are only priced right when
global rank ``r`` really lives on machine ``r // devices_per_machine`` (``cluster.py``).
torchrun numbers ranks node by node; SLURM does under its default block distribution.
This module reads the shape from the launcher's environment (torchrun's
``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, SLURM's ``SLURM_NTASKS``/``SLURM_JOB_NUM_NODES``;
Lightning's own launchers take the Trainer's ``num_nodes`` x ``devices``), checks it
against the Trainer's, learns each rank's node from the ranks themselves, and formats
which ranks of each stage run on which node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dapple.errors import DappleConfigError, require

if TYPE_CHECKING:
    from lightning_dapple.plan.plan import Plan


@dataclass(frozen=True)
class LaunchShape:
    """Nodes x processes per node as the launcher started them, and who said so."""

    nodes: int
    per_node: int
    source: str  # "torchrun", "slurm" or "lightning"


@dataclass(frozen=True)
class Topology:
    shape: LaunchShape
    node_of_rank: tuple[int, ...]


def _slurm_nodes(env: dict[str, str]) -> int | None:
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def launch_shape(environment: Any, num_nodes: int, devices: int, env: dict[str, str] | None = None) -> LaunchShape:
    """The launch's nodes x processes per node, checked against ``Trainer(num_nodes, devices)``.

    Raises ``DappleConfigError`` when the launcher started another shape than the Trainer
    was told (the planner would price links that do not exist)."""
    env = dict(os.environ) if env is None else env
    world = int(environment.world_size())
    if isinstance(environment, TorchElasticEnvironment) and env.get("LOCAL_WORLD_SIZE", "").isdigit():
        per_node = int(env["LOCAL_WORLD_SIZE"])
        shape = LaunchShape(max(1, world // per_node), per_node, "torchrun")
    elif isinstance(environment, SLURMEnvironment) and _slurm_nodes(env):
        nodes = _slurm_nodes(env) or 1
        shape = LaunchShape(nodes, max(1, world // nodes), "slurm")
    else:
        shape = LaunchShape(num_nodes, devices, "lightning")
    require(
        (shape.nodes, shape.per_node) == (num_nodes, devices) and shape.nodes * shape.per_node == world,
        "Trainer(num_nodes, devices)",
        f"is {num_nodes} x {devices}, but {shape.source} started {world} processes as {shape.nodes} node(s) x {shape.per_node}",
        "pass the launch's shape to the Trainer: num_nodes=<nodes>, devices=<processes per node>",
    )
    return shape


def gather_topology(shape: LaunchShape, node_rank: int) -> Topology:
    """Every rank's node, asked of the ranks (a collective: every rank calls it)."""
    nodes: list[Any] = [node_rank]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, node_rank)
    return Topology(shape, tuple(int(n) for n in nodes))


def check_layout(topology: Topology) -> None:
    """Ranks must fill nodes in order (rank r on node r // per_node), as the planner assumes."""
    per_node = topology.shape.per_node
    expected = tuple(rank // per_node for rank in range(len(topology.node_of_rank)))
    if topology.node_of_rank != expected:
        raise DappleConfigError(
            "the launch's rank order",
            f"puts ranks on nodes {list(topology.node_of_rank)}, not node by node ({list(expected)}) as plans assume",
            "launch with torchrun, or srun --distribution=block (SLURM's default)",
        )


def placement_lines(plan: "Plan", topology: Topology) -> list[str]:
    """One line per stage: its layers, its ranks, and which of them run on which node."""
    lines = [f"launch ({topology.shape.source}): {topology.shape.nodes} node(s) x {topology.shape.per_node} process(es)"]
    for index, stage in enumerate(plan.stages):
        by_node: dict[int, list[int]] = {}
        for rank in stage.devices:
            by_node.setdefault(topology.node_of_rank[rank], []).append(rank)
        where = "; ".join(f"node {node}: ranks {ranks}" for node, ranks in sorted(by_node.items()))
        lines.append(f"stage {index}: layers [{stage.start}, {stage.end}) on ranks {list(stage.devices)} ({where})")
    return lines


def report_placement(environment: Any, num_nodes: int, num_processes: int, plan: Plan | None) -> Topology:
    """Launch shape and rank -> node map of the job (Lightning's cluster ``environment``,
    the Trainer's nodes and processes per node), checked; rank 0 logs the plan's placement.
    Called by every rank after the plan is known (a collective)."""
    shape = launch_shape(environment, num_nodes, num_processes)
    topology = gather_topology(shape, int(environment.node_rank()))
    check_layout(topology)
    if plan is not None:
        for line in placement_lines(plan, topology):
            rank_zero_info(f"dapple {line}")
    return topology
