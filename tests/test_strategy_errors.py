"""Bad input to the dapple strategy fails before training with a message naming the fix.

One device, in this process: the checks run in ``setup``, before any step."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_toys import MLPModule, TwoArgumentForward, mlp_loader


class UnknownPrecision(Precision):
    """A precision plugin the strategy has not been taught."""


class FusedAdam(MLPModule):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)

ONE_STAGE = {"global_batch_size": 12, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0]}]}


class NoLayers(MLPModule):
    """No layer sequence, and a forward the tracer cannot follow (it branches on a value)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = self.layers
        del self.layers

    def forward(self, x):
        return self.blocks(x) if x.sum() > -1e9 else x


class ExtraForward(MLPModule):
    def forward(self, x):
        return super().forward(x) * 2.0  # more than the layer sequence


class OwnBackward(MLPModule):
    def backward(self, loss, *args, **kwargs):
        (3.0 * loss).backward(*args, **kwargs)


def _fit(tmp_path: Path, model, plan=ONE_STAGE, precision="64-true", loader=None, **trainer_kwargs):
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=20),
        accelerator="cpu",
        devices=1,
        **({"precision": precision} if "plugins" not in trainer_kwargs else {}),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **trainer_kwargs,
    )
    trainer.fit(model, loader or mlp_loader(2))
    return trainer


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_layers", "NoLayers.forward: cannot be traced into a layer list.*test_strategy_errors.py:.*Fix: give the layer list by hand"),
        ("forward", "does not equal applying 'layers' in order"),
        ("coverage", "ends at layer 3 but the model has 5 layers"),
        ("world", "world size 1"),
        ("split", "cannot be split into 5 equal micro-batches"),
        ("batch", "DataLoader yields batches of 6"),
        ("precision", "does not support"),
        ("two_arguments", "2 positional arguments.*one tuple.*Fix: call self\\(x\\)"),
        ("fused", "16-mixed.*fused optimizer.*cannot agree"),
        ("compiled_whole", "compiled whole.*Fix: compile the blocks instead"),
        ("backward", r"OwnBackward.backward: is overridden.*Fix: put what it does into the loss"),
    ],
)
def test_bad_input_fails_before_training(tmp_path: Path, case: str, match: str) -> None:
    model = {"no_layers": NoLayers, "forward": ExtraForward, "two_arguments": TwoArgumentForward, "fused": FusedAdam, "backward": OwnBackward}.get(
        case, MLPModule
    )().double()
    plan, kwargs = ONE_STAGE, {}
    if case == "coverage":
        plan = {**ONE_STAGE, "stages": [{"layers": [0, 3], "devices": [0]}]}
    elif case == "world":
        plan = {**ONE_STAGE, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
    elif case == "split":
        plan = {**ONE_STAGE, "micro_batches": 5}
    elif case == "batch":
        kwargs["loader"] = mlp_loader(2, rows=6)
    elif case == "precision":
        kwargs["plugins"] = [UnknownPrecision()]
    elif case == "fused":
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu")]
    elif case == "compiled_whole":
        model = torch.compile(model, backend="eager")  # as Lightning's docs compile a LightningModule
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DappleConfigError, match=match) as info:
        _fit(tmp_path, model, plan=plan, **kwargs)
    assert str(info.value).count("Fix:") == 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)  # no step ran


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"schedule": "1f1b"}, "schedule"), ({"policy": "PC"}, "policy"), ({"micro_batches": 0}, "micro_batches"), ({"loss_reduction": "max"}, "loss_reduction"),
     ({"wire": "pigeon"}, "wire.*auto, gloo, staged, nccl"), ({"ooo": "sometimes"}, "ooo.*True, False or 'auto'")],
)
def test_bad_strategy_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(DappleConfigError, match=match):
        DappleStrategy(**kwargs)


@pytest.mark.parametrize(
    ("option", "instead"),
    [
        ("ddp_comm_hook", "own bucketed AllReduce"),
        ("ddp_comm_state", "own bucketed AllReduce"),
        ("ddp_comm_wrapper", "own bucketed AllReduce"),
        ("model_averaging_period", "never diverge"),
        ("find_unused_parameters", "all-reduced as a zero gradient"),
        ("static_graph", "compiled once per plan"),
        ("gradient_as_bucket_view", "copied into their bucket"),
        ("bucket_cap_mb", "buckets are the planner's"),
        ("broadcast_buffers", "does not wrap the model in DDP"),
        ("timeout", "takes timeout_s"),
        ("mixed_precision", "Trainer\\(precision="),
        ("frobnicate", "not an argument of the dapple strategy"),
    ],
)
def test_ddp_only_options_are_refused_with_what_dapple_does_instead(option: str, instead: str) -> None:
    """DDPStrategy would hand these to DDP's wrapper, which the dapple strategy never builds:
    accepted, they would silently do nothing."""
    with pytest.raises(DappleConfigError, match=f"DappleStrategy\\({option}=...\\).*{instead}.*Fix: remove") as info:
        DappleStrategy(**{option: object()})
    assert str(info.value).count("Fix:") == 1


def test_lightning_options_still_pass_through() -> None:
    strategy = DappleStrategy(process_group_backend="gloo", precision_plugin=Precision())
    assert strategy.process_group_backend == "gloo"
    assert isinstance(strategy.precision_plugin, Precision)


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true", "bf16-mixed"])
def test_precision_plugins_are_subclassed_not_patched(tmp_path: Path, precision: str) -> None:
    """Each of Lightning's plugins becomes its pipeline subclass (clipping by the global norm
    is a method of the class, not an attribute patched onto the instance)."""
    from lightning_dapple.strategy.precision import GlobalNormClipping

    model = MLPModule() if precision != "64-true" else MLPModule().double()
    trainer = _fit(tmp_path, model, precision=precision, loader=mlp_loader(2, dtype=torch.float32 if precision != "64-true" else torch.float64))
    plugin = trainer.precision_plugin
    lightning_type = type(plugin).__mro__[2]
    assert isinstance(plugin, GlobalNormClipping) and lightning_type.__module__.startswith("lightning.pytorch.plugins.precision")
    assert "clip_grad_by_norm" not in vars(plugin) and plugin.clip_norm == trainer.strategy._clip_by_global_norm


def test_one_device_plan_trains_like_plain_lightning(tmp_path: Path) -> None:
    """The single-stage, single-device plan is plain gradient accumulation over M slices."""
    from lightning_toys import single_device_run

    model = MLPModule().double()
    _fit(tmp_path, model, gradient_clip_val=0.5)
    reference, _ = single_device_run(2, clip=0.5)
    state = model.state_dict()
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-12


def test_stochastic_weight_averaging_is_refused_on_a_pipeline_and_kept_on_one_stage() -> None:
    """SWA averages a copy of the whole module against self.parameters(), one stage's on a
    pipeline; on a single-stage plan every rank holds the whole model, as under DDP."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.strategy.setup_checks import check_callbacks

    trainer = SimpleNamespace(callbacks=[StochasticWeightAveraging(swa_lrs=0.05)])
    two = plan_from_dict({"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]})
    with pytest.raises(DappleConfigError, match=r"StochasticWeightAveraging: averages a copy of the whole model.*2-stage plan.*Fix: train on a single-stage plan"):
        check_callbacks(trainer, two)
    check_callbacks(trainer, plan_from_dict({"global_batch_size": 4, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}))
