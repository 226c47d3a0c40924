"""Placement: each rank moves only its own stage's layers to its device, after the other
stages' layers were freed; setup's checks and the sample batch stay where the module was
built (the CPU), so the whole model never has to fit one device.

On CPU the "device" of a run is the CPU too, so two stand-ins make placement observable:
the meta device as the rank's device (anything that reaches it has no data, so a check
run there would fail), and layers that record every move applied to them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

import lightning_dapple  # noqa: F401
from lightning_dapple.strategy import DappleStrategy, auto_plan
from lightning_dapple.strategy.module_adapter import FreedLayer
from lightning_toys import quiet_trainer, MLPModule, TrackedMLPModule, mlp_loader, single_device_run

ONE_STAGE = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0]}]}
TWO_STAGES = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


class _SetupDone(Exception):
    pass


class _MetaDeviceStrategy(DappleStrategy):
    """The rank's device is the meta device from ``setup`` on (the process group is made
    before, on the CPU)."""

    in_setup = False

    @property
    def root_device(self) -> torch.device:
        return torch.device("meta") if self.in_setup else super().root_device

    def setup(self, trainer) -> None:
        self.in_setup = True
        super().setup(trainer)

    def teardown(self) -> None:
        self.lightning_module.to_empty(device="cpu")  # meta tensors cannot be copied back
        super().teardown()


class _StopAfterSetup(Callback):
    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        self.devices = {p.device.type for p in pl_module.parameters()}
        raise _SetupDone()


@pytest.mark.parametrize("plan", [ONE_STAGE, "auto"])
def test_setup_runs_its_checks_where_the_module_lives_not_on_the_device(tmp_path: Path, monkeypatch, plan) -> None:
    """The rank's device is the meta device here: the forward check, the sample batch and
    (plan="auto") the profile must not need the model there, and the stage's layers must
    be there once setup is done. A sample batch moved to the device before the layers
    (the order that crashed on CUDA) fails this test."""
    stop = _StopAfterSetup()
    strategy = _MetaDeviceStrategy(plan=plan, timeout_s=20, micro_batches=2 if plan == "auto" else None)
    strategy_profile = {}
    if plan == "auto":  # the profiler moves one layer at a time to the device: on meta, record instead of timing
        real = auto_plan.profile_layers

        def recording_profile(layers, x, device="cpu", **kwargs):
            strategy_profile["device"] = str(device)
            return real(layers, x, device="cpu", **kwargs)

        monkeypatch.setattr(auto_plan, "profile_layers", recording_profile)

        def recording_overhead(profile, device):  # the executor's overhead probe runs on the device too
            strategy_profile["overhead device"] = str(device)
            return profile

        monkeypatch.setattr(auto_plan, "with_action_overhead", recording_overhead)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_steps=1,
        root=tmp_path,
        callbacks=[stop],
    )
    with pytest.raises(_SetupDone):
        trainer.fit(MLPModule().double(), mlp_loader(2))
    assert stop.devices == {"meta"}  # model_to_device moved the stage afterwards
    if plan == "auto":
        assert strategy_profile["device"] == strategy_profile["overhead device"] == "meta"


@pytest.mark.timeout(300)
def test_each_rank_moves_only_its_stage_after_freeing_the_rest(tmp_path: Path) -> None:
    """Two stages on two processes: every rank frees the other stage's layers (moves them
    to meta) before any layer is moved to its device, and moves only its own layers there.
    Training still matches one device and rank 0 gets the whole model back."""
    strategy = DappleStrategy(plan=TWO_STAGES, start_method="spawn", timeout_s=60)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        precision="64-true",
        max_steps=3,
        gradient_clip_val=0.5,
        root=tmp_path,
    )
    model = TrackedMLPModule(str(tmp_path)).double()
    trainer.fit(model, mlp_loader(3))
    owned = {0: {0, 1}, 1: {2, 3, 4}}
    for rank in (0, 1):
        record = json.loads((tmp_path / f"moves_rank{rank}.json").read_text())
        moves = [tuple(move) for move in record["moves"]]
        others = set(range(5)) - owned[rank]
        assert set(record["freed"]) == others
        assert {int(i) for i in record["placed"]} == owned[rank]
        freed_at = [n for n, (index, device) in enumerate(moves) if device == "meta"]
        placed_at = [n for n, (index, device) in enumerate(moves) if device != "meta"]
        assert {moves[n][0] for n in freed_at} == others
        assert {moves[n][0] for n in placed_at} <= owned[rank]  # nothing of another stage reaches the device
        assert placed_at and max(freed_at) < min(placed_at)  # freed before anything moved
    reference, _ = single_device_run(3, clip=0.5)
    state = {k.replace(".inner", ""): v for k, v in model.state_dict().items()}
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    assert not any(isinstance(layer, FreedLayer) for layer in model.layers)


def test_modules_made_in_configure_model_are_made_on_the_cpu(monkeypatch) -> None:
    """Lightning builds ``configure_model``'s layers under the strategy's tensor_init_context,
    which puts them on the rank's device by default: the whole model, before any plan."""
    strategy = DappleStrategy(plan=ONE_STAGE)
    monkeypatch.setattr(DappleStrategy, "root_device", property(lambda self: torch.device("meta")))
    with strategy.tensor_init_context():
        layer = torch.nn.Linear(3, 3)
    assert layer.weight.device.type == "cpu"
