"""A model made in ``configure_model`` (or under ``Trainer.init_module(empty_init=True)``) is
built on the meta device and each rank makes only its stage, with the values building the
whole model on the CPU gives (``strategy/meta_build.py``); a plan shape's cut is chosen from
a profile taken one layer real at a time (``strategy/meta_profile.py``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

import lightning_dapple  # noqa: F401
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.meta_build import MetaBuild

VOCAB, WIDTH, ROWS, LENGTH = 13, 8, 4, 5


class Rotary(nn.Module):
    """A buffer computed at construction (arange, pow) and a parameter made with torch.zeros,
    then written by trunc_normal_."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, WIDTH, 2).float() / WIDTH)), persistent=False)
        self.pos = nn.Parameter(torch.zeros(1, LENGTH, WIDTH))
        nn.init.trunc_normal_(self.pos, std=0.02)

    def forward(self, x):
        return x + self.pos[:, : x.shape[1]] + self.inv_freq.sum()


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.out(self.norm(x))


def layers() -> nn.Sequential:
    """Torch's own modules (their reset_parameters), a padding row, MHA inside an encoder
    layer, BatchNorm's buffers, an embedding the head is tied to, and the Rotary above."""
    embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
    stack = nn.Sequential(
        embedding, Rotary(), nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True), nn.Linear(WIDTH, WIDTH), Head()
    )
    stack[4].out.weight = embedding.weight  # tied after both are made, as GPT-2 does
    return stack


class Built(LightningModule):
    def __init__(self, in_configure_model: bool = True) -> None:
        super().__init__()
        self.in_configure_model = in_configure_model
        if not in_configure_model:
            self.layers = layers()

    def configure_model(self) -> None:
        if self.in_configure_model and not hasattr(self, "layers"):
            self.layers = layers()

    def forward(self, tokens):
        return self.layers(tokens)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return F.cross_entropy(self(tokens).reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self):
        # SGD: the attention's key bias gets no gradient in exact arithmetic, and Adam would
        # scale the rounding noise of its zero gradient up to the learning rate
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_a_recorded_build_replays_the_cpu_builds_values_and_leaves_the_generator_where_it_would() -> None:
    torch.manual_seed(3)
    plain = layers()
    after_plain = torch.rand(3)
    torch.manual_seed(3)
    build = MetaBuild()
    with build.recording():
        meta = layers()
    after_meta = torch.rand(3)
    assert torch.equal(after_plain, after_meta)  # the data order drawn next is plain's
    build.finish(meta)
    assert build.problems == []
    build.materialize(meta, lambda tensor: True)
    for (name, a), (_, b) in zip(plain.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(plain[1].inv_freq, meta[1].inv_freq)
    assert meta[4].out.weight is meta[0].weight  # the tie stays one parameter


def test_only_the_owned_tensors_are_made() -> None:
    build = MetaBuild()
    with build.recording():
        meta = layers()
    build.finish(meta)
    mine = {id(t) for t in meta[2].parameters()}
    build.materialize(meta, lambda tensor: id(tensor) in mine)
    assert all(not p.is_meta for p in meta[2].parameters())
    assert all(p.is_meta for index in (0, 1, 3) for p in meta[index].parameters())


def test_layers_made_one_at_a_time_in_any_order_equal_the_whole_cpu_build() -> None:
    """What plan="auto" does on a meta build (meta_profile.py): each layer made alone, last
    first, holds the values of the whole model built on the CPU under the seed (every
    tensor is replayed from its own generator state), and is freed again afterwards."""
    torch.manual_seed(3)
    plain = layers()
    torch.manual_seed(3)
    build = MetaBuild()
    with build.recording():
        meta = layers()
    build.finish(meta)
    real = build.layer_by_layer(meta)
    for index in reversed(range(len(meta))):
        with real(meta[index]):
            assert all(not t.is_meta for t in meta[index].state_dict().values())
            for name, value in plain[index].state_dict().items():
                assert torch.equal(meta[index].state_dict()[name], value), (index, name)
            mine = [id(p) for p in meta[index].parameters()]
            assert all(p.is_meta for i, layer in enumerate(meta) if i != index for p in layer.parameters() if id(p) not in mine)
        assert all(t.is_meta for t in meta.parameters())


def test_values_the_build_cannot_replay_are_refused_with_the_fix() -> None:
    class FromData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.empty(3, 2))
            with torch.no_grad():
                self.table.copy_(torch.from_numpy(__import__("numpy").ones((3, 2), dtype="float32")))

    build = MetaBuild()
    with build.recording():
        module = FromData()
    build.finish(module)
    with pytest.raises(DappleConfigError, match=r"Owner.configure_model: .*table: .*copy_ copies in values from a tensor of real data.*Fix: .*build the model in __init__"):
        build.check("Owner")


def _data() -> list:
    g = torch.Generator().manual_seed(4)
    return [(torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g), torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)) for _ in range(3)]


class SaveAtEnd(Callback):
    """Writes the whole model's checkpoint at the end of training (every rank takes part):
    under the spawn launcher the launching process's module never ran configure_model."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


def _fit(tmp_path: Path, strategy, devices: int) -> dict:
    torch.manual_seed(11)
    path = tmp_path / "end.ckpt"
    Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False, callbacks=[SaveAtEnd(path)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    ).fit(Built(), DataLoader(_data(), batch_size=None))
    return torch.load(path, weights_only=False)["state_dict"]


@pytest.mark.timeout(300)
def test_a_model_built_in_configure_model_trains_on_two_stages_like_plain_lightning(tmp_path: Path) -> None:
    """Each rank makes its own stage only; the tied head and embedding sit on different stages."""
    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
    ours = _fit(tmp_path / "ours", DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2)
    plain = _fit(tmp_path / "plain", "auto", 1)
    assert set(ours) == set(plain)
    for key, value in plain.items():
        assert torch.allclose(ours[key], value, rtol=1e-10, atol=1e-12), key


@pytest.mark.timeout(300)
def test_a_plan_shape_cuts_a_meta_build_profiled_one_layer_at_a_time_and_trains_like_plain_lightning(tmp_path: Path) -> None:
    """Two stages whose cut the planner chooses: rank 0 profiles each layer made real alone
    (meta_profile.py), then every rank makes its stage. The weights are those of the whole
    model built on the CPU under the seed (each tensor replayed from its own generator
    state, in any order), so training equals plain Lightning."""
    shape = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    ours = _fit(tmp_path / "ours", DappleStrategy(plan=shape, timeout_s=60, start_method="spawn"), 2)
    plain = _fit(tmp_path / "plain", "auto", 1)
    plan = json.loads((tmp_path / "ours" / "dapple_plan.json").read_text())
    assert len(plan["stages"]) == 2
    profile = json.loads((tmp_path / "ours" / "dapple_profile.json").read_text())
    assert profile["meta"]["materialized"] == "one layer at a time (built on the meta device)"
    assert set(ours) == set(plain)
    for key, value in plain.items():
        assert torch.allclose(ours[key], value, rtol=1e-10, atol=1e-12), key


@pytest.mark.timeout(300)
def test_trainer_init_module_with_empty_init_builds_on_meta_and_trains_like_plain_lightning(tmp_path: Path) -> None:
    """``with trainer.init_module(empty_init=True)``: the module made in __init__ is
    recorded on the meta device (the record travels to the spawned ranks with it) and each
    rank makes its own stage, with the values of the CPU build under Lightning's own
    init_module(). Rank 0 holds the embedding only: after fit it rebuilds the other stage's
    layers, the rotary table (a non-persistent buffer, in no checkpoint) included."""

    def fit(strategy, devices: int, empty_init: bool | None) -> dict:
        torch.manual_seed(11)
        path = tmp_path / f"{devices}.ckpt"
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=devices, precision="64-true", max_steps=3, logger=False, callbacks=[SaveAtEnd(path)],
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        )
        with trainer.init_module(empty_init=empty_init):
            model = Built(in_configure_model=False)
        assert all(p.is_meta for p in model.parameters()) == bool(empty_init)
        trainer.fit(model, DataLoader(_data(), batch_size=None))
        return torch.load(path, weights_only=False)["state_dict"]

    plan = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 5], "devices": [1]}]}
    ours = fit(DappleStrategy(plan=plan, timeout_s=60, start_method="spawn"), 2, True)
    plain = fit("auto", 1, None)
    assert set(ours) == set(plain)
    for key, value in plain.items():
        assert torch.allclose(ours[key], value, rtol=1e-10, atol=1e-12), key


class Wide(LightningModule):
    """Float inputs into a Linear built on the meta device: setup's forward check runs on
    meta copies of the sample, the planner's profile on the real one."""

    def configure_model(self) -> None:
        if not hasattr(self, "layers"):
            self.layers = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_plan_auto_on_a_meta_build_with_float_inputs_trains_like_plain_lightning(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 3, generator=g)) for _ in range(3)]

    def fit(strategy) -> dict:
        torch.manual_seed(11)
        model = Wide()
        Trainer(
            strategy=strategy, accelerator="cpu", devices=1, precision="64-true", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        ).fit(model, DataLoader(data, batch_size=None))
        return model.state_dict()

    ours, plain = fit(DappleStrategy(plan="auto", timeout_s=30)), fit("auto")
    assert set(ours) == set(plain)
    for key, value in plain.items():
        assert torch.allclose(ours[key], value, rtol=1e-10, atol=1e-12), key


def test_a_build_that_cannot_be_replayed_names_the_hugging_face_fix() -> None:
    """A value from real data is refused with the fix, which names the pretrained
    directory for a Hugging Face model."""

    class Loaded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(2))
            with torch.no_grad():
                self.table.copy_(torch.ones(2, device="cpu"))

    build = MetaBuild()
    with build.recording():
        module = Loaded()
    build.finish(module)
    with pytest.raises(DappleConfigError, match=r"a Hugging Face model: AutoModel\*.from_config\(config\) with DappleStrategy\(pretrained=directory\)"):
        build.check("Owner")
    build.check("Owner", loaded=lambda name: name == "table")  # a value the directory gives needs no replay
