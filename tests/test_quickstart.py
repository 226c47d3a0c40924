"""The quick start shows a pipeline: its recipe's model does not fit one process's memory
budget (the recipe's cluster file), so ``plan="auto"`` -- run here as the strategy runs it,
on the measured profile of the recipe's model, without training -- splits it into stages. The run's summary puts the measured and the simulated step side by
side and says where the timeline pictures are."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dapple.app.callbacks import MEASURED_TIMELINE, SIMULATED_TIMELINE
from lightning_dapple.app.config import compose_recipe
from lightning_dapple.app.train import prepare, print_run_summary, run_outputs
from lightning_dapple.profile.model_profile import profile_from_dict
from lightning_dapple.strategy.auto_plan import auto_plan
from lightning_dapple.strategy.module_adapter import find_layers

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "bert_pipeline_tiny"


def test_the_quick_start_trains_the_pipeline_recipe() -> None:
    assert f"dapple-train recipe={RECIPE} " in (ROOT / "scripts" / "quickstart.sh").read_text()


@pytest.mark.timeout(300)
def test_the_recipe_does_not_fit_one_process_and_plans_a_pipeline(tmp_path: Path) -> None:
    job = prepare(compose_recipe(RECIPE), tmp_path)
    strategy = job.trainer.strategy
    context = replace(strategy.planning_context(job.trainer), directory=tmp_path)
    job.datamodule.setup("fit")
    batch = next(iter(job.datamodule.train_dataloader()))
    plan = auto_plan(context, job.model, find_layers(job.model, strategy.layers_path), batch).plan
    profile = profile_from_dict(json.loads((tmp_path / "dapple_profile.json").read_text()))
    cluster = context.cluster
    assert cluster.name == "small-memory-cpu" and plan.world_size == job.world_size == 4
    weights = sum(layer.param_bytes for layer in profile.layers) * (2.0 + cluster.optimizer_state_factor)
    assert weights > cluster.device_memory_bytes  # weights, gradients and AdamW state alone overflow one process
    assert plan.num_stages > 1, plan.kind()
    assert "DP needs" in plan.reason  # the plan says why the model was split
    # every stage's optimizer step is priced (AdamW over each layer, timed at set-up)
    assert profile.meta["optimizer"] == "AdamW" and all(layer.optimizer_ms > 0 for layer in profile.layers)


def test_the_summary_sets_measured_and_simulated_step_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "step_times.json").write_text(json.dumps({"steps": 200, "median_step_ms": 187.25, "peak_stash_bytes": 9 * 2**20}))
    (tmp_path / "timeline_simulated.json").write_text(json.dumps({"latency_ms": 30.125}))
    for name in (SIMULATED_TIMELINE, MEASURED_TIMELINE):
        (tmp_path / name).write_bytes(b"png")
    result = {
        "name": RECIPE,
        "run_dir": str(tmp_path),
        "plan": {"kind": "2:2", "micro_batches": 2, "schedule": "dapple", "stages": [{"layers": [0, 5]}, {"layers": [5, 10]}]},
        "metrics": {},
        "wall_s": 40.0,
        **run_outputs(tmp_path),
    }
    assert result["simulated_step_ms"] == 30.125 and result["timelines"] == [str(tmp_path / SIMULATED_TIMELINE), str(tmp_path / MEASURED_TIMELINE)]
    print_run_summary(result)
    lines = capsys.readouterr().out.splitlines()
    measured = next(index for index, line in enumerate(lines) if "step time, measured" in line)
    assert "187.25 ms" in lines[measured] and "step time, simulated" in lines[measured + 1] and "30.12 ms" in lines[measured + 1]
    assert any("2:2 (layers 5:5), M=2" in line for line in lines)
    for name in (SIMULATED_TIMELINE, MEASURED_TIMELINE):
        assert any("timeline picture" in line and str(tmp_path / name) in line for line in lines)
