"""The user's step around the layers (``step_glue_ms``): stored in the profile, priced on the
first and last stages only, and measured at set-up without leaving a trace on the run."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import dapple_latency, stage_costs
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict
from lightning_dapple.plan.polish import _quick_latency
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.profile.step_glue import NO_GLUE, StepGlue
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.strategy.glue_probe import measure_step_glue, with_step_glue

GLUE = StepGlue(input=0.25, loss_forward=1.5, loss_backward=0.75)


def _profile(glue: StepGlue = NO_GLUE) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e3, 1e4, backward_input_ms=1.0, backward_weight_ms=1.0) for i in range(6))
    return ModelProfile(micro_batch_size=8, layers=layers, name="uniform", input_bytes=1e3, step_glue_ms=glue)


def _plan(stages: int, micro_batches: int = 4, recompute: str = "never") -> Plan:
    per = 6 // stages
    return plan_from_dict({
        "global_batch_size": 8 * micro_batches, "micro_batches": micro_batches,
        "stages": [{"layers": [i * per, (i + 1) * per], "devices": [i], "recompute": recompute} for i in range(stages)],
    })


# --------------------------------------------------------------------------- the profile JSON


def test_profile_json_round_trips_the_glue_and_leaves_it_out_when_none() -> None:
    data = json.loads(_profile(GLUE).to_json())
    assert data["step_glue_ms"] == {"input": 0.25, "loss_forward": 1.5, "loss_backward": 0.75}
    assert profile_from_dict(data).step_glue_ms == GLUE
    assert "step_glue_ms" not in json.loads(_profile().to_json())
    assert profile_from_dict(json.loads(_profile().to_json())).step_glue_ms == NO_GLUE


@pytest.mark.parametrize(
    ("value", "match"), [({"input": -1.0}, "finite number >= 0"), ({"loss": 1.0}, "unknown parts"), ([1.0], "not a JSON object")]
)
def test_bad_glue_is_refused_with_the_field(value: object, match: str) -> None:
    data = json.loads(_profile().to_json()) | {"step_glue_ms": value}
    with pytest.raises(DappleConfigError, match=match):
        profile_from_dict(data)


# --------------------------------------------------------------------------- the cost model


def test_the_first_stage_pays_the_input_and_the_last_the_loss() -> None:
    cluster = Cluster(1, 3)
    plan = _plan(3)
    plain = stage_costs(_profile(), cluster, plan.stages, 8)
    glued = stage_costs(_profile(GLUE), cluster, plan.stages, 8)
    assert glued[0].forward_ms - plain[0].forward_ms == pytest.approx(GLUE.input)
    assert glued[0].backward_ms == plain[0].backward_ms
    assert glued[1] == plain[1]  # a middle stage runs no user code
    assert glued[2].forward_ms - plain[2].forward_ms == pytest.approx(GLUE.loss_forward)
    assert glued[2].backward_ms - plain[2].backward_ms == pytest.approx(GLUE.loss_backward)
    assert glued[2].backward_input_ms - plain[2].backward_input_ms == pytest.approx(GLUE.loss_backward)
    assert glued[2].backward_weight_ms == plain[2].backward_weight_ms


def test_a_stage_priced_alone_is_first_or_last_by_its_layers_not_its_place_in_the_list() -> None:
    """The planner prices one stage at a time (``plan/enumerate.py``); a stage of the middle
    layers must not pay the user's step because it is the list's only entry."""
    cluster = Cluster(1, 1)
    middle = stage_costs(_profile(GLUE), cluster, [StagePlan(layers=(2, 4), devices=(0,))], 8)[0]
    assert middle == stage_costs(_profile(), cluster, [StagePlan(layers=(2, 4), devices=(0,))], 8)[0]


def test_a_replay_runs_the_layers_again_not_the_users_step() -> None:
    plan = _plan(1, recompute="always")
    glued = stage_costs(_profile(GLUE), Cluster(1, 1), plan.stages, 8)[0]
    plain = stage_costs(_profile(), Cluster(1, 1), plan.stages, 8)[0]
    assert glued.recompute_ms == plain.recompute_ms


def test_one_stage_simulates_the_whole_step_once_per_micro_batch() -> None:
    """A stage holding every layer runs the user's step once per micro-batch, whole: the
    code before ``self(...)`` is in ``loss_forward`` and is not charged again as ``input``."""
    cluster, plan = Cluster(1, 1), _plan(1, micro_batches=4)
    grown = simulate_plan(plan, _profile(GLUE), cluster).latency_ms - simulate_plan(plan, _profile(), cluster).latency_ms
    assert grown == pytest.approx(4 * (GLUE.loss_forward + GLUE.loss_backward))


def test_the_planners_quick_pricing_adds_the_glue_as_the_cost_model_does() -> None:
    profile, cluster, plan = _profile(GLUE), Cluster(1, 3), _plan(3)
    quick, _ = _quick_latency(RangeTables(profile), cluster, plan.stages, 8, plan.micro_batches, "PA", "dapple")
    assert quick == pytest.approx(dapple_latency(stage_costs(profile, cluster, plan.stages, 8), plan.micro_batches).latency_ms)
    plain, _ = _quick_latency(RangeTables(_profile()), cluster, plan.stages, 8, plan.micro_batches, "PA", "dapple")
    assert quick > plain


# --------------------------------------------------------------------------- the probe

SLEEP_S = 0.004


class _Glued(LightningModule):
    """Two linear layers; its step sleeps before or after ``self(...)``, adds a weight penalty
    to the loss, logs, and counts its batches in a metric."""

    def __init__(self, before: bool) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.before = before
        self.seen = torchmetrics.SumMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.before:
            time.sleep(SLEEP_S)
        out = self(x)
        if not self.before:
            time.sleep(SLEEP_S)
        loss = F.mse_loss(out, y) + 1e-3 * self.layers[0].weight.square().sum()
        self.seen.update(torch.tensor(float(x.shape[0])))
        self.log("train_loss", loss)
        return loss


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


@pytest.mark.parametrize("before", [True, False])
def test_the_probe_times_the_users_code_where_it_runs(before: bool) -> None:
    module = _Glued(before)
    batch = _batch()
    glue = measure_step_glue(module, module.layers, batch, batch[0], torch.device("cpu"), repeats=3, warmup=1)
    slept_ms = SLEEP_S * 1000
    # the code before self(...) runs in both calls; the code after only in the loss's
    assert (glue.input >= slept_ms) is before
    assert glue.loss_forward >= slept_ms
    assert glue.loss_forward < slept_ms * 4 and glue.loss_backward < slept_ms


def test_the_probe_leaves_metrics_gradients_and_the_random_stream_as_they_were() -> None:
    module = _Glued(before=False)
    module.seen.update(torch.tensor(5.0))
    batch = _batch()
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    measure_step_glue(module, module.layers, batch, batch[0], torch.device("cpu"), repeats=2, warmup=1)
    assert torch.equal(torch.rand(3), expected_draw)
    assert module.seen.compute().item() == 5.0 and module.seen._update_count == 1
    assert all(param.grad is None for param in module.parameters())  # the penalty's gradient was not accumulated


def test_a_step_the_probe_cannot_run_charges_no_glue_and_says_why() -> None:
    class Broken(_Glued):
        def training_step(self, batch, batch_idx):
            out = self(batch[0])
            raise RuntimeError("needs the trainer")

    module = Broken(before=False)
    batch = _batch()
    with pytest.warns(UserWarning, match="not timed for the planner"):
        profile = with_step_glue(_profile(), module, module.layers, batch, batch[0], torch.device("cpu"))
    assert profile.step_glue_ms == NO_GLUE
    assert profile.meta["step_glue"] == "not measured: RuntimeError: needs the trainer"
    elsewhere = with_step_glue(_profile(), module, module.layers, batch, batch[0], torch.device("cuda"))
    assert elsewhere.step_glue_ms == NO_GLUE
    assert elsewhere.meta["step_glue"] == "not measured: the planning batch is on cpu while the run trains on cuda"
    working = with_step_glue(_profile(), _Glued(False), _Glued(False).layers, batch, batch[0], torch.device("cpu"))
    assert not working.step_glue_ms.is_zero and working.meta["step_glue"] == "measured on the run's training_step"
    assert replace(working, step_glue_ms=NO_GLUE, meta={}) == _profile()
