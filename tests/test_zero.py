"""ZeRO-1 inside replicated stages (``strategy/zero.py``): each replica keeps its share of
the optimizer state, steps it and sends what it stepped to the others; training equals one
process in float64, the state per replica halves on two replicas, and its checkpoints
resume under another plan."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from conformance.behaviours import BATCH, Classifier, dataset
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.zero import assign_owners

DP = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}
HYBRID = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}]}


def test_shares_are_balanced_and_the_same_on_every_replica() -> None:
    params = [torch.empty(n) for n in (100, 10, 60, 50, 5, 5)]
    owners = assign_owners(params, 2)
    assert owners == assign_owners(params, 2)
    loads = [sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(p.numel() for p in params)
    assert sorted(set(assign_owners(params, 3))) == [0, 1, 2]


def test_zero_other_than_0_or_1_is_refused() -> None:
    with pytest.raises(DappleConfigError, match=r"zero: is 2.*Fix: use 0"):
        DappleStrategy(plan=DP, zero=2)


class StateBytes(Callback):
    """Each rank writes the bytes of optimizer state it holds after training."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        total = sum(v.numel() * v.element_size() for opt in trainer.optimizers for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(total))


class SaveAtEnd(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def _fit(root: Path, strategy, devices: int, epochs: int = 1, ckpt_path: str | None = None, callbacks: list | None = None) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    model = Classifier().double()
    end = root / "end.ckpt"
    Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
        gradient_clip_val=0.5, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[SaveAtEnd(end), *(callbacks or [])],
    ).fit(model, DataLoader(dataset(), batch_size=BATCH), ckpt_path=ckpt_path)
    return torch.load(end, weights_only=False)


def _assert_equal(ours: dict, plain: dict) -> None:
    for key, value in plain["state_dict"].items():
        assert torch.allclose(ours["state_dict"][key], value, rtol=1e-10, atol=1e-12), key


def _dapple(plan: dict, **kwargs) -> DappleStrategy:
    return DappleStrategy(plan=plan, timeout_s=60, start_method="spawn", **kwargs)


@pytest.mark.timeout(400)
def test_zero_1_trains_like_one_process_on_a_data_parallel_plan_with_recomputation_and_halves_the_state(tmp_path: Path) -> None:
    plain = _fit(tmp_path / "plain", "auto", 1)
    sharded = _fit(tmp_path / "zero", _dapple(DP, zero=1, recompute="always"), 2, callbacks=[StateBytes(tmp_path / "zero")])
    _assert_equal(sharded, plain)
    whole = _fit(tmp_path / "whole", _dapple(DP), 2, callbacks=[StateBytes(tmp_path / "whole")])
    per_replica = [json.loads((tmp_path / "zero" / f"rank{r}.json").read_text()) for r in range(2)]
    full = [json.loads((tmp_path / "whole" / f"rank{r}.json").read_text()) for r in range(2)]
    assert full[0] == full[1] and sum(per_replica) == full[0]  # the shares partition the state
    largest = 2 * 8 * 8 * 8  # one parameter's Adam moments (8x8 float64): the granularity of a share
    assert all(abs(share - full[0] / 2) <= largest for share in per_replica)
    _assert_equal(whole, plain)


@pytest.mark.timeout(600)
def test_zero_1_on_a_hybrid_plan_with_ooo_trains_like_one_process_and_resumes_under_another_plan(tmp_path: Path) -> None:
    """2 stages x 2 replicas, out-of-order backprop, clipping: equal to one process; its
    consolidated checkpoint (each replica's share gathered) resumes on a 1-stage plan
    without ZeRO, equal to one process trained for both epochs."""
    plain_one = _fit(tmp_path / "plain1", "auto", 1)
    ours = _fit(tmp_path / "hybrid", _dapple({**HYBRID, "ooo": True}, zero=1), 4)
    _assert_equal(ours, plain_one)
    assert len(ours["optimizer_states"][0]["state"]) == len(plain_one["optimizer_states"][0]["state"])  # every share saved
    plain_two = _fit(tmp_path / "plain2", "auto", 1, epochs=2)
    resumed = _fit(tmp_path / "resumed", _dapple(DP), 2, epochs=2, ckpt_path=str(tmp_path / "hybrid" / "end.ckpt"))
    _assert_equal(resumed, plain_two)


@pytest.mark.timeout(600)
def test_a_sharded_checkpoint_of_zero_1_replicas_resumes_under_another_plan(tmp_path: Path) -> None:
    """Every replica writes its share of the state into the sharded checkpoint; a 1-stage
    plan without ZeRO resumes from it like one process trained for both epochs."""
    from lightning_dapple.strategy.sharded_checkpoint import consolidate

    root = tmp_path / "sharded"
    root.mkdir()
    directory = root / "end.ckpt"
    Trainer(
        strategy=_dapple({**HYBRID, "ooo": True}, zero=1, checkpoint="sharded"), accelerator="cpu", devices=4, precision="64-true",
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(root), gradient_clip_val=0.5, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[SaveAtEnd(directory)],
    ).fit(Classifier().double(), DataLoader(dataset(), batch_size=BATCH))
    consolidate(directory, tmp_path / "one.ckpt")
    plain_one = _fit(tmp_path / "plain1", "auto", 1)
    assert set(torch.load(tmp_path / "one.ckpt", weights_only=False)["optimizer_states"][0]["state"]) >= set(plain_one["state_dict"]) - {
        k for k in plain_one["state_dict"] if not k.endswith(("weight", "bias"))
    }
    plain_two = _fit(tmp_path / "plain2", "auto", 1, epochs=2)
    resumed = _fit(tmp_path / "resumed", _dapple(DP), 2, epochs=2, ckpt_path=str(directory))
    _assert_equal(resumed, plain_two)
