"""A second attribute path to a layer (``self.head = self.layers[-1]``), to a part of one
(``self.middle_linear = self.layers[1][0]``) or to a parameter beside the layer sequence.

In this process: each stage's view of the module after freeing (what setup then moves to
the device and what its checkpoint part holds), and rank 0's whole module after the rebuild.
On two processes: training on a 2-stage plan equals one process, the checkpoint loads into
the plain module, and every rank finishes with the paths its stage owns.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_dapple  # noqa: F401
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.handles import Detached, LayerTensors
from lightning_dapple.strategy.module_adapter import FreedLayer
from lightning_dapple.profile.traced_layers import traced_layers
from lightning_toys import quiet_trainer
from traced_toys import Handles, ScaledGPT, plain_run, relative_difference, token_loader, vector_loader

STAGES = [(0, 2), (2, 4)]  # layers [0, 2) and [2, 4): the middle_linear handle on stage 0, head on stage 1


def _free_like_setup(model: Handles, stage: range) -> tuple[LayerTensors, dict[int, torch.nn.Module], Detached]:
    """What ``DappleStrategy._prepare_pipeline`` does to a rank's module."""
    tensors = LayerTensors.of(model, model.layers, keep_transient=True)
    detached = tensors.detach(model, model.layers, stage, lambda index: 0 if index < 2 else 1)
    freed = {}
    for index in range(len(model.layers)):
        if index not in stage:
            freed[index] = model.layers[index].to("meta")
            model.layers[index] = FreedLayer(index, 0 if index < 2 else 1)
    return tensors, freed, detached


@pytest.mark.parametrize("stage", [0, 1])
def test_each_stage_holds_only_its_paths_and_can_move_to_its_device(stage: int) -> None:
    model = Handles().double()
    whole = {key: value.clone() for key, value in model.state_dict().items()}
    _free_like_setup(model, range(*STAGES[stage]))
    model.to("cpu")  # model_to_device: "Cannot copy out of meta tensor" when a path still reaches a freed layer
    state = model.state_dict()
    assert not any(value.is_meta for value in state.values())
    expected = {"layers.0.0.weight", "layers.0.0.bias", "layers.1.0.weight", "layers.1.0.bias", "middle_linear.weight", "middle_linear.bias"}
    if stage == 1:
        expected = {"layers.2.0.weight", "layers.2.0.bias", "layers.3.weight", "layers.3.bias", "head.weight", "head.bias", "head_bias"}
    assert set(state) == expected  # the handle's keys live with the layer they name
    assert all(torch.equal(state[key], whole[key]) for key in expected)
    assert isinstance(model.head if stage == 0 else model.middle_linear, FreedLayer)
    assert (model.head_bias is None) == (stage == 0)
    assert sum(p.numel() for p in model.parameters()) == sum(whole[key].numel() for key in expected if not key.startswith(("head", "middle")))


def test_rank_zero_rebuilds_the_model_with_every_path_shared_again() -> None:
    trained = Handles(seed=99).double()
    state = trained.state_dict()  # the consolidated checkpoint state
    model = Handles().double()
    tensors, freed, detached = _free_like_setup(model, range(*STAGES[0]))
    for index, skeleton in sorted(freed.items()):
        model.layers[index] = tensors.rebuild(skeleton, index, state)
    detached.reattach(model.layers)
    assert model.head is model.layers[3] and model.middle_linear is model.layers[1][0] and model.head_bias is model.layers[3].bias
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items() if key.startswith(("layers.2", "layers.3", "head")))


def test_a_traced_model_gets_the_tensors_its_forward_reads_back() -> None:
    """Layer 0 of a traced list (the embedding, ``pos_emb`` and the non-persistent
    ``emb_scale`` that forward reads) lives on another stage: this rank holds neither path
    to them; rank 0's rebuild ties the module's attributes to the rebuilt layer again."""
    idx = next(iter(token_loader()))[0]
    trained = ScaledGPT(seed=5).double()
    model = ScaledGPT().double()
    layers = traced_layers(model, [(idx[:1],), (idx[:2],)])
    tensors = LayerTensors.of(model, layers, keep_transient=True)
    detached = tensors.detach(model, layers, range(1, len(layers)), lambda index: 0 if index == 0 else 1)
    skeleton = layers[0].to("meta")
    layers[0] = FreedLayer(0, 0)
    model.to("cpu")  # nothing of layer 0 is reachable from the module any more
    assert not {"pos_emb", "tok_emb.weight"} & set(model.state_dict()) and isinstance(model.tok_emb, FreedLayer)
    assert model.emb_scale is None
    layers[0] = tensors.rebuild(skeleton, 0, trained.state_dict())
    detached.reattach(layers)
    assert model.pos_emb is layers[0].get_parameter("pos_emb") and model.emb_scale is layers[0].get_buffer("emb_scale")
    assert model.tok_emb is layers[0].get_submodule("tok_emb")
    assert torch.equal(model.pos_emb, trained.pos_emb) and float(model.emb_scale) == 0.5
    with torch.no_grad():
        assert torch.equal(layers[0](idx), trained.tok_emb(idx) * 0.5 + trained.pos_emb[:, : idx.shape[1]])


class _RankRecord(Callback):
    """Per rank, after training: the module's state keys, and whether each handle is freed."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        record = {
            "keys": sorted(pl_module.state_dict()),
            "head_freed": isinstance(pl_module.head, FreedLayer),
            "middle_freed": isinstance(pl_module.middle_linear, FreedLayer),
            "finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
        }
        Path(self.directory, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.timeout(600)
def test_handles_train_and_checkpoint_on_two_stages(tmp_path: Path) -> None:
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": list(STAGES[0]), "devices": [0]}, {"layers": list(STAGES[1]), "devices": [1]}]}
    reference = plain_run(Handles(), vector_loader())
    model = Handles().double()
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=90),
        accelerator="cpu",
        devices=2,
        precision="64-true",
        max_steps=3,
        root=tmp_path,
        enable_checkpointing=True,
        callbacks=[saved, _RankRecord(str(tmp_path))],
    )
    trainer.fit(model, vector_loader())
    assert relative_difference(model.state_dict(), reference) <= 1e-10
    assert model.head is model.layers[-1] and model.middle_linear is model.layers[1][0]  # rank 0: the paths are one module again
    assert model.head_bias is model.layers[-1].bias
    plain = Handles().double()
    plain.load_state_dict(torch.load(next((tmp_path / "ckpt").iterdir()), weights_only=False)["state_dict"])  # strict
    assert relative_difference(plain.state_dict(), reference) <= 1e-10
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(record["finite"] for record in ranks)
    assert [record["head_freed"] for record in ranks] == [True, False] and [record["middle_freed"] for record in ranks] == [False, True]
    assert "head.weight" in ranks[1]["keys"] and "middle_linear.weight" in ranks[0]["keys"]
