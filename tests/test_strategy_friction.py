"""What a first-time user runs into: each case either works like plain Lightning or stops
before training with one clear message."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import quiet_trainer, AliasedLayers, MLPModule, mlp_loader, single_device_run

TWO_STAGES = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


def _trainer(tmp_path: Path, strategy, devices: int = 1, steps: int = 3, **kwargs) -> Trainer:
    return quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        precision="64-true",
        max_steps=steps,
        root=tmp_path,
        **kwargs,
    )


@pytest.mark.timeout(300)
def test_a_second_reference_to_the_layers_trains_and_consolidates(tmp_path: Path) -> None:
    """``self.model.layers is self.layers``: both state-dict paths belong to the layer's
    stage, so checkpoints and the model handed back to rank 0 hold both."""
    model = AliasedLayers().double()
    trainer = _trainer(tmp_path, DappleStrategy(plan=TWO_STAGES, start_method="spawn", timeout_s=60), devices=2, gradient_clip_val=0.5)
    trainer.fit(model, mlp_loader(3))
    reference, _ = single_device_run(3, clip=0.5)
    state = model.state_dict()
    assert {k for k in state if k.startswith("model.layers.")} == {f"model.{k}" for k in reference}
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    assert all(torch.equal(state[f"model.{k}"], state[k]) for k in reference)


def _plain_accumulating(tmp_path: Path, steps: int, accumulate: int) -> dict[str, torch.Tensor]:
    model = MLPModule().double()
    _trainer(tmp_path, "auto", steps=steps, accumulate_grad_batches=accumulate, gradient_clip_val=0.5).fit(model, mlp_loader(4))
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("plan", ["auto", {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 5], "devices": [0]}]}])
def test_accumulate_grad_batches_matches_plain_lightning(tmp_path: Path, plan) -> None:
    """Trainer(accumulate_grad_batches=2) with plan="auto" or a plan with M=3: each batch's
    pipelined step adds its gradients to the earlier batches' ones, as plain Lightning."""
    reference = _plain_accumulating(tmp_path / "plain", steps=2, accumulate=2)
    model = MLPModule().double()
    strategy = DappleStrategy(plan=plan, timeout_s=20, micro_batches=3 if plan == "auto" else None)
    _trainer(tmp_path / "dapple", strategy, steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(model, mlp_loader(4))
    state = model.state_dict()
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    one_batch_steps = _plain_accumulating(tmp_path / "plain1", steps=2, accumulate=1)
    assert max(float((one_batch_steps[k] - reference[k]).abs().max()) for k in reference) > 1e-4  # accumulation mattered


def test_no_plan_fits_reaches_the_user_once(tmp_path: Path) -> None:
    """plan="auto" on a device too small: the planner's message arrives as it was written
    (one 'Fix:'), not wrapped in a second error."""
    tiny = {"name": "tiny", "machines": 1, "devices_per_machine": 1, "device_memory_gib": 1e-7}
    with pytest.raises(DappleConfigError) as info:
        _trainer(tmp_path, DappleStrategy(plan="auto", cluster=tiny, timeout_s=20), steps=1).fit(MLPModule().double(), mlp_loader(2))
    message = str(info.value)
    assert message.count("Fix:") == 1 and "planning failed on rank 0" not in message
    assert "GiB" in message
