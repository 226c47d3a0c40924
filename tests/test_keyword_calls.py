"""``self(...)`` called by keyword, as Hugging Face-style code does.

A step that calls ``self(input_ids=ids, attention_mask=mask)`` or ``self(**batch)`` has its
arguments bound to ``forward``'s parameters by name and handed to layer 0 (or the traced
program) by position (``strategy/module_adapter.positional_arguments``); parameters left at
their defaults keep them, also flags whose default is not None (fx guards those with an
assertion the traced layers drop, ``profile/trace.py``). A ``forward`` that computes the
loss from ``labels`` and returns a dict trains like plain Lightning on two stages.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from lightning_dapple.cli.profile import main as profile_main
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile import load_profile
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.module_adapter import positional_arguments

VOCAB, LENGTH, ROWS, WIDTH = 13, 5, 4, 8


class LMOutput(OrderedDict):
    """Hugging Face's ``ModelOutput`` in small: a dict subclass read by attribute or key."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Prediction:
    logits: torch.Tensor
    hidden: torch.Tensor


def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _forward(input_ids, attention_mask=None, labels=None, return_dict=True):
    """The shape of a Hugging Face model's forward."""


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((), {"input_ids": "I", "attention_mask": "M"}, ("I", "M")),
        (("I",), {"attention_mask": "M"}, ("I", "M")),
        ((), {"attention_mask": "M", "input_ids": "I"}, ("I", "M")),  # by name, not by order
        ((), {"input_ids": "I", "labels": "L"}, ("I", None, "L")),  # the skipped one at its default
        ((), {"input_ids": "I", "attention_mask": None, "return_dict": True}, ("I",)),  # trailing defaults left to forward
        ((), {"input_ids": "I", "return_dict": False}, ("I", None, None, False)),
        (("I", None), {"return_dict": True}, ("I", None)),  # what was passed by position stays
    ],
)
def test_keywords_are_bound_to_forwards_parameters_by_name(args: tuple, kwargs: dict, expected: tuple) -> None:
    assert positional_arguments(_signature(_forward), args, kwargs) == expected


def _keyword_only(input_ids, *, attention_mask=None):
    """A parameter that cannot be given by position."""


def _var_keyword(input_ids, **extra):
    """Extra keywords collected into a dict."""


@pytest.mark.parametrize(
    ("function", "kwargs", "words"),
    [
        (_keyword_only, {"input_ids": "I", "attention_mask": "M"}, r"passes 'attention_mask', which forward.* takes only by keyword.*Fix: make 'attention_mask' a positional parameter"),
        (_var_keyword, {"input_ids": "I", "mask": "M"}, r"passes 'extra', which forward.* takes only by keyword \(or in \*\*kwargs\)"),
        (_forward, {"attention_mask": "M"}, r"does not match forward\(input_ids, .*missing a required argument: 'input_ids'"),
        (_forward, {"input_ids": "I", "token_type_ids": "T"}, r"does not match forward.*unexpected keyword argument 'token_type_ids'"),
    ],
)
def test_keywords_that_cannot_be_positional_or_do_not_fit_are_refused(function, kwargs: dict, words: str) -> None:
    with pytest.raises(DappleConfigError, match=words):
        positional_arguments(_signature(function), (), kwargs, "Model")


# --------------------------------------------------------------------------- a model as people write it


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.mlp(hidden)) * mask.unsqueeze(-1)


class HFStyleLM(LightningModule):
    """forward(input_ids, attention_mask=None, labels=None, return_dict=True): the loss is
    computed in forward when labels are given and returned in an ``LMOutput``; the steps
    pass ``**batch`` and read ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.example_input_array = {"input_ids": torch.zeros(2, LENGTH, dtype=torch.long), "attention_mask": torch.ones(2, LENGTH)}

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=True):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=self.head.weight.dtype)
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden, attention_mask)
        logits = self.head(hidden)
        loss = None if labels is None else F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return LMOutput(loss=loss, logits=logits) if return_dict else (loss, logits)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])["loss"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batches(count: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    batches = [
        {
            "input_ids": torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
            "attention_mask": (torch.rand(ROWS, LENGTH, generator=g) > 0.3).double(),
            "labels": torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g),
        }
        for _ in range(count)
    ]
    return DataLoader(batches, batch_size=None)


@pytest.mark.timeout(300)
def test_a_hugging_face_style_model_called_by_keyword_trains_like_plain_lightning(tmp_path: Path) -> None:
    """Two stages of the layers traced from forward, M = 2: the labels travel to the last
    stage, which computes forward's loss; parameters and the validation loss are plain
    Lightning's in float64."""

    def fit(strategy, devices: int) -> tuple[dict, float]:
        model = HFStyleLM().double()
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        trainer.fit(model, _batches(3, 5), _batches(1, 6))
        return model.state_dict(), float(trainer.callback_metrics["val_loss"])

    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    ours, ours_val = fit(DappleStrategy(plan=plan, layers="auto", timeout_s=60, start_method="spawn"), 2)
    plain, plain_val = fit("auto", 1)
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12
    assert ours_val == pytest.approx(plain_val, abs=1e-12)
    assert not torch.equal(ours["head.weight"], HFStyleLM().double().state_dict()["head.weight"])  # it trained


class ValidatesWithoutLabels(HFStyleLM):
    def validation_step(self, batch, batch_idx):
        logits = self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["logits"]
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)))


def test_a_step_passing_other_arguments_than_the_traced_call_is_refused_before_training(tmp_path: Path) -> None:
    """The layers were traced from training_step's call (with labels: the loss is part of the
    program); a validation_step without labels would run another program. Lightning's sanity
    check meets it before the first training step."""
    model = ValidatesWithoutLabels().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"devices": [0]}]}
    trainer = Trainer(
        strategy=DappleStrategy(plan=plan, layers="auto", timeout_s=20), accelerator="cpu", devices=1, precision="64-true",
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    words = r"validation_step: calls self\(...\) with 2 argument\(s\), but the layer list was traced from forward on a call with 3 \(input_ids, attention_mask, labels\).*Fix: pass the same arguments"
    with pytest.raises(DappleConfigError, match=words):
        trainer.fit(model, _batches(2, 5), _batches(1, 6))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class DataclassOutput(HFStyleLM):
    """forward returns a dataclass; the step reads its fields."""

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden, attention_mask)
        return Prediction(logits=self.head(hidden), hidden=hidden)

    def training_step(self, batch, batch_idx):
        out = self(batch["input_ids"], batch["attention_mask"])
        return F.cross_entropy(out.logits.reshape(-1, VOCAB), batch["labels"].reshape(-1)) + out.hidden.pow(2).mean()

    def validation_step(self, batch, batch_idx):
        pass


def test_a_dataclass_output_is_checked_field_by_field_and_trains_like_plain_lightning(tmp_path: Path) -> None:
    def fit(strategy) -> dict:
        model = DataclassOutput().double()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        ).fit(model, _batches(2, 7))
        return model.state_dict()

    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"devices": [0]}]}
    ours, plain = fit(DappleStrategy(plan=plan, layers="auto", timeout_s=20)), fit("auto")
    assert max(float((ours[k] - v).abs().max()) for k, v in plain.items()) < 1e-12


class Predicting(HFStyleLM):
    def predict_step(self, batch, batch_idx):
        return self(input_ids=batch["input_ids"]).logits  # one input; the training step passes three


class Written(BasePredictionWriter):
    """A spawned run returns no predictions: rank 0 writes each batch's."""

    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="batch")
        self.out = out

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        if trainer.global_rank == 0:
            torch.save(prediction, self.out / f"prediction{batch_idx}.pt")


@pytest.mark.timeout(300)
def test_predict_on_a_fresh_trainer_plans_from_the_predict_steps_call(tmp_path: Path) -> None:
    """A plan shape on a Trainer that only predicts: the layers are traced from
    predict_step's self(...) (no labels), and the profile that cuts them is measured on
    that call's input too."""

    def predict(strategy, devices: int) -> list[torch.Tensor]:
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", logger=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[Written(tmp_path)],
        )
        trainer.predict(Predicting().double(), _batches(2, 8), return_predictions=False)
        return [torch.load(tmp_path / f"prediction{index}.pt") for index in range(2)]

    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    ours = predict(DappleStrategy(plan=plan, layers="auto", timeout_s=60, start_method="spawn"), 2)
    plain = predict("auto", 1)
    assert len(ours) == len(plain) == 2
    assert max(float((a - b).abs().max()) for a, b in zip(ours, plain)) < 1e-12


def make_hf_style() -> HFStyleLM:
    return HFStyleLM()


def test_the_profile_command_takes_an_example_input_given_by_keyword(tmp_path: Path, capsys) -> None:
    """``example_input_array`` as a dict (Lightning calls forward(**it)): the traced layers
    are profiled on it, layer 0 taking (input_ids, attention_mask)."""
    out = tmp_path / "profile.json"
    code = profile_main(["--model", f"{__name__}:make_hf_style", "--repeats", "1", "--warmup", "0", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    profile = load_profile(out)
    assert profile.num_layers == 5 and profile.micro_batch_size == 2
    assert "layer list traced from HFStyleLM.forward (5 layers)" in captured.out
