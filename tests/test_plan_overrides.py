"""``DappleStrategy(schedule=..., micro_batches=..., policy=...)`` override a plan given as a
dict, a file or a ``Plan``; the plan is checked after the override (``strategy/resolve.py``):
a plan whose stages repeat their devices is valid only under the chunked schedule the
argument names."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.resolve import PlanArguments, given_plan, resolve_plan
from lightning_toys import MLPModule, assert_trained_like_one_device, mlp_loader

# the MLP's 5 layers as 4 stages on 2 ranks, no schedule named: "dapple" by default
CHUNKED = {
    "global_batch_size": 12,
    "micro_batches": 4,
    "stages": [{"layers": [a, b], "devices": [k % 2], "warmup": 2} for k, (a, b) in enumerate([(0, 1), (1, 2), (2, 4), (4, 5)])],
}


def _resolved(spec, **arguments) -> Plan:
    plan_arguments = PlanArguments(**arguments)
    given = given_plan(spec, plan_arguments)
    assert isinstance(given, Plan)
    return resolve_plan(given, plan_arguments).validate(num_layers=5, world_size=2)


def test_without_the_override_a_plan_repeating_devices_is_refused() -> None:
    with pytest.raises(DappleConfigError, match="plan.schedule"):
        given_plan(CHUNKED, PlanArguments())


@pytest.mark.parametrize("source", ["dict", "file"])
@pytest.mark.parametrize(("arguments", "expected"), [
    ({"schedule": "interleaved"}, {"schedule": "interleaved", "micro_batches": 4}),
    ({"schedule": "interleaved", "micro_batches": 2}, {"schedule": "interleaved", "micro_batches": 2}),
    ({"schedule": "zbv", "policy": "PB"}, {"schedule": "zbv", "policy": "PB"}),
])
def test_the_arguments_override_a_chunked_plan_given_as_a_dict_or_a_file(tmp_path: Path, source: str, arguments: dict, expected: dict) -> None:
    spec = CHUNKED
    if expected["schedule"] == "zbv":  # a V: rank 0 holds the first and the last stage
        spec = {**CHUNKED, "stages": [{**stage, "devices": [device]} for stage, device in zip(CHUNKED["stages"], (0, 1, 1, 0))]}
    if source == "file":
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(spec))
        spec = str(path)
    plan = _resolved(spec, **arguments)
    for name, value in expected.items():
        assert getattr(plan, name) == value
    assert all(stage.warmup is None for stage in plan.stages)  # written for "dapple": refilled by the policy


def test_the_arguments_override_a_plan_object() -> None:
    plan = plan_from_dict({**CHUNKED, "schedule": "interleaved"})
    assert _resolved(plan, schedule="interleaved", micro_batches=6).micro_batches == 6
    with pytest.raises(DappleConfigError, match="plan.micro_batches"):
        _resolved(plan, micro_batches=5)  # checked after the override: 12 rows do not split in 5


@pytest.mark.timeout(300)
def test_a_chunked_plan_dict_with_the_schedule_argument_trains_like_one_device(tmp_path: Path) -> None:
    trainer = Trainer(
        strategy=DappleStrategy(plan=CHUNKED, schedule="interleaved", start_method="spawn", timeout_s=60), accelerator="cpu", devices=2,
        precision="64-true", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), gradient_clip_val=0.5, limit_val_batches=1,
    )
    model = MLPModule().double()
    trainer.fit(model, mlp_loader(3), mlp_loader(1))
    assert_trained_like_one_device(model, trainer)
