"""``DappleStrategy(tune_steps=N)`` on 2 processes: training after the trials is exactly the
kept plan's untuned training (float64; BatchNorm statistics and dropout draws included), and
the next run with the same model, cluster and batch reads the kept plan from the cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import MLPModule, mlp_loader, single_device_run

class NormDropModule(LightningModule):
    """BatchNorm (running statistics a trial would move) and dropout (random draws a trial
    would consume) in a four-layer MLP, and a metric its step updates (a trial would add to
    it), whose state each rank writes to ``report_dir`` when training ends, with how many of
    its modules an out-of-order stage routes (a trial's routes must not outlive it)."""

    def __init__(self, report_dir: str = "") -> None:
        super().__init__()
        self.report_dir = report_dir
        self.seen = torchmetrics.MeanMetric()
        self.layers = nn.Sequential(
            nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2), nn.Tanh()),
            nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()),
            nn.Linear(16, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.seen.update(loss.detach())
        return loss

    def on_train_end(self) -> None:
        routed = sum("forward" in module.__dict__ for module in self.modules())  # out-of-order routes (execute/weight_grad.py)
        state = {"updates": self.seen._update_count, "mean": float(self.seen.compute()), "routed": routed}
        (Path(self.report_dir) / f"seen_rank{self.global_rank}.json").write_text(json.dumps(state))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def norm_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(36, 6, generator=generator, dtype=torch.float64)
    return DataLoader(TensorDataset(x, x[:, :2].sin()), batch_size=12, shuffle=False)


def fit(root: Path, model: LightningModule, loader: DataLoader, gradient_clip_val: float | None = 0.5, **strategy) -> dict:
    trainer = Trainer(
        strategy=DappleStrategy(start_method="spawn", timeout_s=60, **strategy), accelerator="cpu", devices=2, precision="64-true", max_steps=3,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root),
        gradient_clip_val=gradient_clip_val,
    )
    trainer.fit(model, loader)
    return json.loads(next(root.rglob("dapple_plan.json")).read_text())


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_tuned_training_equals_one_device_and_the_next_run_reads_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    reference, _ = single_device_run(3, clip=0.5)
    for attempt in ("measured", "cached"):
        model = MLPModule().double()
        plan = fit(tmp_path / attempt, model, mlp_loader(3), plan="auto", tune_steps=2, profile_cache=str(cache))
        record = plan["extra"]["tuning"]
        assert record["cached"] is (attempt == "cached")
        assert len(record["candidates"]) >= 2 and all(row["measured_ms"] > 0 for row in record["candidates"])
        fastest, first = min(record["candidates"], key=lambda row: row["measured_ms"]), record["candidates"][0]
        clear_win = fastest["measured_ms"] < first["measured_ms"] * (1 - record["margin"])
        assert record["chosen"] == (fastest if clear_win else first)["label"] and record["simulator_choice"] == first["label"]
        assert record["optimizer"] == "stepped"  # MLPModule's Adam, copied for the trials
        state = model.state_dict()
        assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
    assert len(list(cache.glob("tuning-*.json"))) == 1


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_trials_leave_no_trace_in_batchnorm_statistics_or_dropout_draws(tmp_path: Path) -> None:
    torch.manual_seed(7)
    tuned_model = NormDropModule(str(tmp_path)).double()
    tuned = fit(tmp_path / "tuned", tuned_model, norm_loader(), plan="auto", tune_steps=2, tune_candidates=4, profile_cache=str(tmp_path / "cache"))
    assert len(tuned["extra"]["tuning"]["candidates"]) >= 2
    seen_tuned = [json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in range(2)]
    kept = {key: value for key, value in tuned.items() if key not in ("extra", "reason", "predicted", "planner")}
    torch.manual_seed(7)
    plain_model = NormDropModule(str(tmp_path)).double()
    fit(tmp_path / "plain", plain_model, norm_loader(), plan=kept, ooo=bool(kept.get("ooo", False)))  # as kept: no ooo="auto" of its own
    seen_plain = [json.loads((tmp_path / f"seen_rank{rank}.json").read_text()) for rank in range(2)]
    # the trials' updates were put back: the same count, routes and mean (each rank's metric
    # holds its own updates, strategy/unshare.py, so the float32 sums run in one order)
    assert [(s["updates"], s["routed"], s["mean"]) for s in seen_plain] == [(s["updates"], s["routed"], s["mean"]) for s in seen_tuned]
    assert max(state["updates"] for state in seen_tuned) > 0
    tuned_state, plain_state = tuned_model.state_dict(), plain_model.state_dict()
    assert set(tuned_state) == set(plain_state)
    assert any("running_mean" in key for key in tuned_state)
    assert max(float((tuned_state[k].double() - plain_state[k].double()).abs().max()) for k in plain_state) == 0.0


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_a_hugging_face_model_kept_whole_tunes_and_trains_as_its_kept_plan(tmp_path: Path) -> None:
    """GPT-2 from a config, kept whole, with its embedding tied to its head and dropout 0.1:
    tuning tries plans that split the tie between ranks and others that keep it on one, and
    the run afterwards equals an untuned run of the kept plan."""
    pytest.importorskip("transformers")
    import functools

    import hf_toys

    make = functools.partial(hf_toys.LitLM, hf_toys.gpt2_config(dropout=0.1))
    loader = lambda: DataLoader(hf_toys.lm_batches(), batch_size=None)  # noqa: E731
    tuned_model = make().double()
    tuned = fit(tmp_path / "tuned", tuned_model, loader(), plan="auto", tune_steps=1, tune_candidates=3, profile_cache=str(tmp_path / "cache"), gradient_clip_val=None)
    assert len(tuned["extra"]["tuning"]["candidates"]) >= 2
    kept = {key: value for key, value in tuned.items() if key not in ("extra", "reason", "predicted", "planner")}
    plain_model = make().double()
    fit(tmp_path / "plain", plain_model, loader(), plan=kept, ooo=bool(kept.get("ooo", False)), gradient_clip_val=None)
    tuned_state, plain_state = tuned_model.state_dict(), plain_model.state_dict()
    assert all(torch.equal(tuned_state[k], v) for k, v in plain_state.items())
    assert torch.equal(tuned_state["model.lm_head.weight"], tuned_state["model.transformer.wte.weight"])
