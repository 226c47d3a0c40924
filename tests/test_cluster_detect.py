"""cluster=auto: the planner plans for the machine it runs on (torch.cuda mocked here)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_dapple.cluster import GIB, detect_cluster
from lightning_dapple.errors import DappleConfigError


def _fake_gpus(monkeypatch, memories_gib: list[float], name: str = "NVIDIA H100 80GB HBM3") -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(memories_gib))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(memories_gib))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=int(memories_gib[index] * GIB)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)


def test_gpus_are_detected_with_their_name_and_smallest_memory(monkeypatch) -> None:
    _fake_gpus(monkeypatch, [79.1, 39.4, 79.1])
    one = detect_cluster(1, 1, "auto")
    assert (one.machines, one.devices_per_machine, one.device_memory_gib) == (1, 1, 79.1)
    assert one.name == "local-NVIDIA H100 80GB HBM3"
    two = detect_cluster(2, 2, "gpu")  # the run uses GPUs 0 and 1: the smaller one bounds every stage
    assert (two.machines, two.devices_per_machine, two.device_memory_gib) == (2, 2, 39.4)


def test_cpu_processes_share_the_host_memory(monkeypatch) -> None:
    _fake_gpus(monkeypatch, [80.0])
    from lightning_dapple import cluster as module

    monkeypatch.setattr(module, "_host_memory_gib", lambda: 64.0)
    cpu = detect_cluster(1, 4, "cpu")  # asked for CPU: the GPU is not used
    assert (cpu.name, cpu.device_memory_gib) == ("local-cpu", 16.0)
    _fake_gpus(monkeypatch, [])
    assert detect_cluster(1, 2, "auto").device_memory_gib == 32.0
    with pytest.raises(DappleConfigError, match="no CUDA device"):
        detect_cluster(1, 1, "gpu")


def test_the_app_detects_unless_a_cluster_is_named(monkeypatch) -> None:
    """recipe=bert trainer.devices=1 on an 80 GB GPU plans for that GPU, not the paper's V100s."""
    from lightning_dapple.app.config import compose_recipe
    from lightning_dapple.app.train import _cluster

    _fake_gpus(monkeypatch, [79.1])
    cfg = compose_recipe("bert", ["trainer.devices=1"])
    assert (cfg.cluster.name, cfg.trainer.num_nodes) == ("auto", 1)
    detected = _cluster(cfg, 1, 1, "gpu")
    assert (detected["device_memory_gib"], detected["name"], detected["devices_per_machine"]) == (79.1, "local-NVIDIA H100 80GB HBM3", 1)
    named = _cluster(compose_recipe("bert", ["cluster=paper-a"]), 2, 8, "gpu")
    assert (named["name"], named["device_memory_gib"]) == ("paper-a", 16.0)
    assert named["shared_cores"] is None  # GPUs compute on their own


def test_cpu_runs_on_a_named_cluster_share_this_machines_cores(monkeypatch) -> None:
    """The quick start's cluster file (small-memory-cpu) sets memory and links; the cores the
    run's processes share are this machine's, unless the file names them."""
    from lightning_dapple.app import train
    from lightning_dapple.app.config import compose_recipe

    monkeypatch.setattr(train, "usable_cores", lambda: 2)
    quick = train._cluster(compose_recipe("bert_pipeline_tiny"), 1, 4, "cpu")
    assert (quick["name"], quick["shared_cores"]) == ("small-memory-cpu", 2)
    named = train._cluster(compose_recipe("bert_pipeline_tiny", ["cluster.shared_cores=6"]), 1, 4, "cpu")
    assert named["shared_cores"] == 6
