"""Mixed precision under the dapple strategy against plain Lightning with the same precision.

``bf16-mixed`` runs on the CPU as Lightning gives it; ``16-mixed`` on the CPU is Lightning's
``MixedPrecision("16-mixed", "cpu")`` plugin (fp16 autocast and a CPU GradScaler), which
the Trainer's ``precision="16-mixed"`` flag would turn into bf16 on a CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_dapple  # noqa: F401  (registers the strategies)
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.precision import DappleMixedPrecision, agree_found_inf
from lightning_toys import quiet_trainer, FloatMLPModule, ScaleRecorder, mlp_loader


def _plan(micro_batches: int, cuts: tuple[int, ...] = ()) -> dict:
    edges = [0, *cuts, 5]
    stages = [{"layers": [a, b], "devices": [i]} for i, (a, b) in enumerate(zip(edges, edges[1:]))]
    return {"global_batch_size": 12, "micro_batches": micro_batches, "stages": stages}


def _fit(tmp_path: Path, precision: str, strategy=None, steps: int = 3, devices: int = 1, model=None, callbacks=(), **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else FloatMLPModule()
    flags = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    trainer = quiet_trainer(
        strategy=strategy if strategy is not None else "auto",
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        root=tmp_path,
        callbacks=list(callbacks),
        **flags,
        **kwargs,
    )
    trainer.fit(model, mlp_loader(steps, dtype=torch.float32))
    return {k: v.clone() for k, v in model.state_dict().items()}, trainer


def _diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_matches_plain_lightning(tmp_path: Path, precision: str) -> None:
    """One micro-batch runs the same autocast ops as Lightning: equal weights. Two micro-
    batches differ only by the rounding of the halves, far less than dropping autocast."""
    reference, plain = _fit(tmp_path / "plain", precision)
    same, trainer = _fit(tmp_path / "m1", precision, DappleStrategy(plan=_plan(1), timeout_s=20))
    assert isinstance(trainer.precision_plugin, DappleMixedPrecision)
    assert _diff(same, reference) == 0.0
    full, _ = _fit(tmp_path / "fp32", "32-true")
    without_autocast = _diff(full, reference)
    assert without_autocast > 0.0
    halves, _ = _fit(tmp_path / "m2", precision, DappleStrategy(plan=_plan(2), timeout_s=20))
    assert _diff(halves, reference) < without_autocast / 2  # nearer plain mixed than plain float32 is
    if precision == "16-mixed":
        assert trainer.precision_plugin.scaler.get_scale() == plain.precision_plugin.scaler.get_scale()


def test_recomputation_replays_the_forward_in_the_autocast_dtype(tmp_path: Path) -> None:
    """A recomputed stage forward must run under autocast as the first one did, or its
    gradients come from float32 activations and differ from the stored-activation run."""
    kept, _ = _fit(tmp_path / "kept", "bf16-mixed", DappleStrategy(plan=_plan(2), timeout_s=20, ooo=False, recompute="never"))
    replayed, _ = _fit(tmp_path / "replayed", "bf16-mixed", DappleStrategy(plan=_plan(2), timeout_s=20, ooo=False, recompute="always"))
    assert _diff(kept, replayed) == 0.0


def test_agree_found_inf_without_a_process_group_keeps_the_local_answer() -> None:
    """One process: the agreed record is this rank's own (and the step is skipped on inf)."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    param.grad = torch.tensor([4.0, float("inf"), 4.0])
    scaler.unscale_(optimizer)
    assert float(agree_found_inf(scaler, optimizer, torch.device("cpu"))) == 1.0
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(3)) and scaler.get_scale() == 2.0


@pytest.mark.timeout(300)
def test_inf_on_one_stage_makes_every_rank_skip_the_step(tmp_path: Path) -> None:
    """fp16 on two pipeline stages; at step 1 only stage 1's gradients overflow. Both ranks
    must skip that step and halve the scale together, and the result must equal plain
    Lightning skipping the same step. Without the agreement, stage 0 would step."""
    out = tmp_path / "dapple"
    out.mkdir()
    strategy = DappleStrategy(plan=_plan(1, cuts=(2,)), start_method="spawn", timeout_s=60)
    model = FloatMLPModule(poison=(1, 1))
    got, _ = _fit(out, "16-mixed", strategy, steps=3, devices=2, model=model, callbacks=[ScaleRecorder(str(out))])
    rows = [json.loads((out / f"scale_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert rows[0] == rows[1]  # same scale and same number of optimizer steps on both stages
    assert [row["adam_steps"] for row in rows[0]] == [1.0, 1.0, 2.0]  # step 1 skipped
    assert rows[0][1]["scale"] == rows[0][0]["scale"] / 2
    plain = tmp_path / "plain"
    plain.mkdir()
    reference, _ = _fit(plain, "16-mixed", steps=3, model=FloatMLPModule(poison=(1, 0)), callbacks=[ScaleRecorder(str(plain))])
    assert json.loads((plain / "scale_rank0.json").read_text()) == rows[0]
    assert _diff(got, reference) < 1e-6
