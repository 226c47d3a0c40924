"""The strategy on CUDA devices: placement, precision and profiling on a real GPU.

Skipped where torch sees no CUDA device (CI); run them on a GPU machine with
``pytest tests/test_cuda.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

import lightning_dapple  # noqa: F401
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import quiet_trainer, FloatMLPModule, MLPModule, mlp_loader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ONE_STAGE = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0]}]}
TWO_STAGES = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


def _fit(tmp_path: Path, model, strategy, precision: str, devices: int = 1, callbacks=(), dtype=torch.float64) -> dict[str, torch.Tensor]:
    flags = {"plugins": [MixedPrecision("16-mixed", "cuda")]} if precision == "16-mixed" else {"precision": precision}
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=devices,
        max_steps=3,
        root=tmp_path,
        callbacks=list(callbacks),
        **flags,
    )
    trainer.fit(model, mlp_loader(3, dtype=dtype))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def test_one_gpu_trains_like_plain_lightning(tmp_path: Path) -> None:
    """Setup must not run the sample batch (on the GPU) through layers still on the CPU."""
    reference = _fit(tmp_path / "plain", MLPModule().double(), "auto", "64-true")
    got = _fit(tmp_path / "dapple", MLPModule().double(), DappleStrategy(plan=ONE_STAGE, timeout_s=60), "64-true")
    assert _diff(got, reference) < 1e-10


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_on_one_gpu_matches_plain_lightning(tmp_path: Path, precision: str) -> None:
    plan = {**ONE_STAGE, "micro_batches": 1}
    torch.manual_seed(0)
    reference = _fit(tmp_path / "plain", FloatMLPModule(), "auto", precision, dtype=torch.float32)
    torch.manual_seed(0)
    got = _fit(tmp_path / "dapple", FloatMLPModule(), DappleStrategy(plan=plan, timeout_s=60), precision, dtype=torch.float32)
    assert _diff(got, reference) < 1e-6


def _profile_peak_bytes(layers: nn.Sequential) -> int:
    """Peak GPU memory above what was allocated before, while ``layers`` are profiled."""
    from lightning_dapple.profile.profiler import profile_layers

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    profile = profile_layers(layers, torch.randn(8, 4096), device="cuda", repeats=1, warmup=0)
    assert len(profile.layers) == len(layers)
    return torch.cuda.max_memory_allocated() - base


def test_profiling_holds_one_layer_on_the_gpu_at_a_time() -> None:
    """Eight 64 MiB layers: the profile's peak GPU memory is that of profiling one such layer
    (its weight, gradients, activations and cuBLAS's workspace), not a second layer more,
    and far below the 512 MiB of the whole model."""
    _profile_peak_bytes(nn.Sequential(nn.Linear(4096, 4096, bias=False)))  # cuBLAS and the allocator warm
    one = _profile_peak_bytes(nn.Sequential(nn.Linear(4096, 4096, bias=False)))
    layers = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(8)))
    eight = _profile_peak_bytes(layers)
    assert eight < one + 16 * 2**20 and eight < 256 * 2**20, (one, eight)
    assert all(p.device.type == "cpu" for p in layers.parameters())  # each went back


class _MemoryAfterSetup(Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_fit_start(self, trainer, pl_module) -> None:
        on_gpu = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.device.type == "cuda")
        with open(f"{self.directory}/gpu_rank{trainer.global_rank}.json", "w") as stream:
            json.dump({"param_bytes_on_gpu": on_gpu, "allocated": torch.cuda.memory_allocated()}, stream)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_hold_only_their_stage(tmp_path: Path) -> None:
    model = MLPModule().double()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    strategy = DappleStrategy(plan=TWO_STAGES, start_method="spawn", timeout_s=60)
    _fit(tmp_path, model, strategy, "64-true", devices=2, callbacks=[_MemoryAfterSetup(str(tmp_path))])
    for rank in (0, 1):
        record = json.loads((tmp_path / f"gpu_rank{rank}.json").read_text())
        assert 0 < record["param_bytes_on_gpu"] < total
