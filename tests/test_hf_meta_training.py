"""Hugging Face models built on the meta device train on two processes like
``from_pretrained`` on one.

A tiny Llama and GPT-2 are saved with ``save_pretrained``; the pipeline's module makes the
model from the directory's config on the meta device (in ``configure_model``, or under
``Trainer.init_module(empty_init=True)``) and names the directory with
``DappleStrategy(pretrained=...)``, so each rank reads only its stage's tensors
(``strategy/hf_weights.py``). Plain Lightning on one process loads the same directory with
``from_pretrained``. After 3 AdamW steps in float64 every parameter is within a relative
1e-10 of plain Lightning's.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import hf_toys  # noqa: E402
from lightning_dapple.strategy import DappleStrategy  # noqa: E402


class SaveAtEnd(Callback):
    """The whole trained model's checkpoint (every rank takes part): under the spawn
    launcher the launching process's module stays as it was built."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def _trainer(tmp_path: Path, strategy, devices: int, callbacks=()) -> Trainer:
    return Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=list(callbacks),
    )


def _from_pretrained(tmp_path: Path, directory: Path) -> dict:
    """Plain Lightning on one process, the model loaded with from_pretrained in __init__."""
    model = hf_toys.LitLM(directory=str(directory))
    _trainer(tmp_path / "plain", "auto", 1).fit(model, DataLoader(hf_toys.lm_batches(), batch_size=None))
    return model.state_dict()


def _relative_difference(ours: dict, plain: dict) -> float:
    assert set(ours) == set(plain)
    scale = max(float(v.abs().max()) for v in plain.values() if v.is_floating_point())
    return max(float((ours[k] - v).abs().max()) for k, v in plain.items() if v.is_floating_point()) / scale


def _saved(config, directory: Path, seed: int, **options) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, **options)
    return directory


@pytest.mark.timeout(300)
def test_llama_from_a_sharded_directory_on_a_cut_the_planner_chooses_trains_like_from_pretrained(tmp_path: Path) -> None:
    """Built in configure_model; two stages whose cut the planner chooses from a profile
    taken one layer at a time (each read from the directory alone); the rotary tables
    (never saved) are Hugging Face's own."""
    directory = _saved(hf_toys.llama_config(), tmp_path / "llama", 21, max_shard_size="4KB")
    shape = {"global_batch_size": hf_toys.ROWS, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    strategy = DappleStrategy(plan=shape, pretrained=str(directory), timeout_s=60, start_method="spawn")
    path = tmp_path / "ours.ckpt"
    _trainer(tmp_path / "ours", strategy, 2, [SaveAtEnd(path)]).fit(hf_toys.LitLMOnMeta(directory=str(directory)), DataLoader(hf_toys.lm_batches(), batch_size=None))
    ours = torch.load(path, weights_only=False)["state_dict"]
    plain = _from_pretrained(tmp_path, directory)
    difference = _relative_difference(ours, plain)
    print(f"llama, pretrained on meta: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    start = hf_toys.LitLM(directory=str(directory)).double().state_dict()
    assert not torch.equal(plain["model.lm_head.weight"], start["model.lm_head.weight"])  # it trained


@pytest.mark.timeout(300)
def test_gpt2_made_under_init_module_with_its_tied_head_on_the_other_stage_trains_like_from_pretrained(tmp_path: Path) -> None:
    """``with trainer.init_module(empty_init=True): LitLM(config)``: the model made in
    __init__ is built on the meta device; the head's weight is wte's (stored once), on the
    other stage than the embedding, so both stages read it."""
    from transformers import AutoConfig

    directory = _saved(hf_toys.gpt2_config(), tmp_path / "gpt2", 22)
    plan = {"global_batch_size": hf_toys.ROWS, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, 6], "devices": [1]}]}
    path = tmp_path / "ours.ckpt"
    trainer = _trainer(tmp_path / "ours", DappleStrategy(plan=plan, pretrained=str(directory), timeout_s=60, start_method="spawn"), 2, [SaveAtEnd(path)])
    with trainer.init_module(empty_init=True):
        model = hf_toys.LitLM(AutoConfig.from_pretrained(directory))
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, DataLoader(hf_toys.lm_batches(), batch_size=None))
    ours = torch.load(path, weights_only=False)["state_dict"]
    plain = _from_pretrained(tmp_path, directory)
    difference = _relative_difference(ours, plain)
    print(f"gpt2, pretrained under init_module: max relative difference {difference:.3g}")
    assert difference <= 1e-10
    assert torch.equal(ours["model.lm_head.weight"], ours["model.transformer.wte.weight"])
