"""``DappleStrategy(plan="auto")`` with the schedule chosen or named: the planner cuts the
chunks, and the run trains exactly as one device does (2 processes, float64, 3 steps)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import MLPModule, mlp_loader, single_device_run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule", ["zbv", "auto"])
def test_planned_schedule_trains_like_one_device(tmp_path: Path, schedule: str) -> None:
    strategy = DappleStrategy(plan="auto", schedule=schedule, micro_batches=4, start_method="spawn", timeout_s=60)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        precision="64-true",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        gradient_clip_val=0.5,
    )
    model = MLPModule().double()
    trainer.fit(model, mlp_loader(3))
    plan = json.loads(next(tmp_path.rglob("dapple_plan.json")).read_text())
    choice = plan["extra"]["schedule_choice"]
    assert choice["chosen"] is not None and plan["reason"].split("Schedule ")[1].startswith(choice["chosen"])
    if schedule == "zbv":
        assert plan["schedule"] == "zbv" and [s["devices"] for s in plan["stages"]] == [[0], [1], [1], [0]]
    else:
        assert {c["schedule"] for c in choice["candidates"]} == {"dapple", "gpipe", "interleaved", "zbv"}
    reference, _ = single_device_run(3, clip=0.5, epochs=1)
    state = model.state_dict()
    assert max(float((state[k] - reference[k]).abs().max()) for k in reference) < 1e-10
