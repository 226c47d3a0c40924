"""The user's ``training_step`` around ``self(...)`` (``ModelProfile.step_glue_ms``): timed at
set-up without touching the step's metrics or logs, kept in the profile JSON, and priced on
the last stage's forward, once per slice."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torchmetrics
from lightning.pytorch import Trainer

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.step_glue import step_glue_ms
from lightning_toys import MLPModule, mlp_loader


def chain(n: int) -> ModelProfile:
    return ModelProfile(2, tuple(LayerProfile(f"layer{i}", 1.0, 2.0, 1e3, 1e3, 1e3) for i in range(n)))


def test_the_last_stage_pays_the_glue_once_per_slice_and_a_replay_does_not() -> None:
    stages = (StagePlan((0, 2), (0,), recompute="always"), StagePlan((2, 4), (1, 2), recompute="always"))
    plain = stage_costs(chain(4), Cluster(1, 3), stages, micro_batch_size=4)
    glued = stage_costs(replace(chain(4), step_glue_ms=0.7), Cluster(1, 3), stages, micro_batch_size=4)
    assert glued[0].forward_ms == plain[0].forward_ms
    assert glued[1].forward_ms == pytest.approx(plain[1].forward_ms + 0.7)  # per slice, whatever its rows
    assert glued[1].recompute_ms == plain[1].recompute_ms  # the replay runs the layers only


def test_the_profile_json_keeps_it_and_refuses_a_bad_value() -> None:
    profile = replace(chain(2), step_glue_ms=0.25)
    assert profile_from_dict(json.loads(profile.to_json())).step_glue_ms == 0.25
    assert "step_glue_ms" not in chain(2).to_dict()
    with pytest.raises(DappleConfigError) as error:
        profile_from_dict({**chain(2).to_dict(), "step_glue_ms": -1.0})
    assert error.value.field == "profile.step_glue_ms"


class MetricStep(MLPModule):
    """MLPModule whose step also updates a torchmetrics metric (not logged, so Lightning never
    resets it) and counts its calls in a plain attribute, which nothing puts back."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = torchmetrics.MeanMetric()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        loss = super().training_step(batch, batch_idx)
        self.seen.update(loss.detach())
        return loss


def test_timing_the_step_leaves_its_metric_and_never_runs_the_layers() -> None:
    module = MetricStep().double()
    x, y = next(iter(mlp_loader(1)))
    output = torch.zeros_like(y)
    calls = []
    module.layers.register_forward_hook(lambda *args: calls.append(1))
    assert step_glue_ms(module, (x, y), output) > 0
    assert calls == [] and module.seen._update_count == 0  # self(...) answered by the output; the updates put back


def test_plan_auto_measures_it_into_the_profile(tmp_path: Path) -> None:
    trainer = Trainer(
        strategy=DappleStrategy(plan="auto", micro_batches=1, timeout_s=60), accelerator="cpu", devices=1, precision="64-true", max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )
    module = MetricStep().double()
    trainer.fit(module, mlp_loader(1))
    profile = json.loads(next(tmp_path.rglob("dapple_profile.json")).read_text())
    assert profile["step_glue_ms"] > 0
    assert module.calls > 6  # the set-up's timing called the step: one untimed call and 5 timed ones ...
    assert module.seen._update_count == 1  # ... and put the metric back: only the one slice of the one step counts
