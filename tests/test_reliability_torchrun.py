"""Multi-node launches: two torchrun "nodes" on this host train to the single-process
parameters, with the launch's shape and each rank's node known to the strategy; SLURM's
environment (set by hand) gives the same ranks and shape as torchrun's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import lightning_dapple  # noqa: F401  (registers the strategies)
from dist_harness import free_port
from lightning_toys import single_device_run
from scripts.reliability_launch import session_processes, start

# each stage's two replicas on different nodes: activations, gradients and the stage's
# AllReduce all cross the node boundary
ACROSS_NODES = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0, 2]}, {"layers": [2, 5], "devices": [1, 3]}]}


@pytest.mark.timeout(240)
def test_torchrun_two_nodes_matches_single_process(tmp_path: Path) -> None:
    cfg = {"plan": ACROSS_NODES, "devices": 2, "num_nodes": 2, "steps": 3, "final": True, "topology": True}
    job = start(cfg, tmp_path, launcher="torchrun", port=free_port())
    try:
        codes, text, _ = job.wait(200)
    finally:
        job.kill()
    assert codes == [0, 0], text[-4000:]
    saved = torch.load(tmp_path / "final.ckpt", weights_only=False)
    reference, losses = single_device_run(3, clip=0.5)
    state = saved["state_dict"]
    assert set(state) == set(reference)
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    got = json.loads((tmp_path / "losses.json").read_text())
    assert [got[str(s)] for s in (1, 2, 3)] == pytest.approx(losses, abs=1e-10)
    topology = json.loads((tmp_path / "topology.json").read_text())
    assert (topology["source"], topology["nodes"], topology["per_node"]) == ("torchrun", 2, 2)
    assert topology["node_of_rank"] == [0, 0, 1, 1]
    assert topology["lines"][1:] == [
        "stage 0: layers [0, 2) on ranks [0, 2] (node 0: ranks [0]; node 1: ranks [2])",
        "stage 1: layers [2, 5) on ranks [1, 3] (node 0: ranks [1]; node 1: ranks [3])",
    ]
    assert not session_processes(job)


def _torchrun_env(rank: int) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "GROUP_RANK": str(rank // 2), "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "TORCHELASTIC_RUN_ID": "job",
    }


def _slurm_env(rank: int) -> dict[str, str]:
    """What ``srun --nodes 2 --ntasks-per-node 2`` sets in task ``rank``."""
    return {
        "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2), "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2", "SLURM_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "1234", "SLURM_JOB_NAME": "train", "MASTER_PORT": "29555",
    }


def _ranks_under(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple:
    from lightning.pytorch import Trainer

    from lightning_dapple.execute.topology import launch_shape
    from lightning_dapple.strategy import DappleStrategy

    for key in [k for k in list(os.environ) if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(strategy=DappleStrategy(plan=ACROSS_NODES), accelerator="cpu", num_nodes=2, devices=2, logger=False)
    environment = trainer.strategy.cluster_environment
    shape = launch_shape(environment, trainer.num_nodes, trainer.strategy.num_processes)
    ranks = (environment.global_rank(), environment.local_rank(), environment.node_rank(), environment.world_size())
    return type(environment).__name__, ranks, (shape.nodes, shape.per_node)


@pytest.mark.timeout(60)
def test_slurm_environment_gives_torchruns_ranks_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in range(4):
        with monkeypatch.context() as patch:
            kind, ranks, shape = _ranks_under(_slurm_env(rank), patch)
        assert kind == "SLURMEnvironment"
        with monkeypatch.context() as patch:
            torchrun = _ranks_under(_torchrun_env(rank), patch)
        assert torchrun == ("TorchElasticEnvironment", ranks, shape)
        assert ranks == (rank, rank % 2, rank // 2, 4) and shape == (2, 2)


@pytest.mark.timeout(30)
def test_a_launch_of_another_shape_than_the_trainers_is_refused() -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.topology import launch_shape

    class FourTasks(SLURMEnvironment):
        def world_size(self) -> int:
            return 4

    with pytest.raises(DappleConfigError, match="slurm started 4 processes as 4 node"):
        launch_shape(FourTasks(), num_nodes=2, devices=2, env={"SLURM_JOB_NUM_NODES": "4"})


@pytest.mark.timeout(30)
def test_ranks_not_laid_out_node_by_node_are_refused() -> None:
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.topology import LaunchShape, Topology, check_layout

    check_layout(Topology(LaunchShape(2, 2, "slurm"), (0, 0, 1, 1)))
    with pytest.raises(DappleConfigError, match="--distribution=block"):
        check_layout(Topology(LaunchShape(2, 2, "slurm"), (0, 1, 0, 1)))  # srun --distribution=cyclic
