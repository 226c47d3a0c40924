"""The layer list found from forward: models with no layer sequence, traced with torch.fx
(child modules are leaves) and cut between child-module calls.

In this process: which layers are found, that they compute forward (values and gradients
bit for bit), and the one-line failure. One process group of 4 ranks: every plan (straight,
hybrid 2x2, three stages; out-of-order backprop and recomputation on) against one process.
Trainer launches: a plan given by its shape only, on the nanoGPT-shaped module, and the
ResNet-shaped one, through the real strategy, with checkpoints.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.transformer import LightningTransformer

import lightning_dapple  # noqa: F401
from dist_harness import run_ranks
from lightning_dapple.cli import plan as plan_cli
from lightning_dapple.cli import profile as profile_cli
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile.ties import tied_parameters
from lightning_dapple.profile.traced_layers import TracedLayers, traced_layers
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.module_adapter import check_parameters_in_layers, find_layers
from lightning_toys import quiet_trainer
from traced_toys import (
    ModeDependent,
    NanoGPT,
    SkipMasked,
    SmallResNet,
    TiedHead,
    Untraceable,
    image_loader,
    plain_run,
    relative_difference,
    token_loader,
    vector_loader,
)
from traced_worker import run_traced_cases


def _samples(x: torch.Tensor, *more: torch.Tensor) -> list[tuple]:
    return [(x[:1], *(m[:1] for m in more)), (x[:2], *(m[:2] for m in more))]


def _chain(layers: TracedLayers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_nanogpt_blocks_are_layers_and_the_position_parameter_stays_with_its_use() -> None:
    model = NanoGPT().double()
    idx = next(iter(token_loader()))[0]
    layers = traced_layers(model, _samples(idx))
    assert layers.calls == [["tok_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["ln_f"], ["head"]]
    holders = [index for index, layer in enumerate(layers) if any(p is model.pos_emb for p in layer.parameters())]
    assert holders == [0]  # x + self.pos_emb[:, :t]: the layer that reads it
    assert all(layers[1 + i].get_submodule(f"blocks.{i}") is model.blocks[i] for i in range(3))  # the blocks themselves, untraced
    check_parameters_in_layers(model, layers, "auto")  # every parameter in exactly one layer
    assert torch.equal(_chain(layers, idx), model(idx))
    described = layers.describe()
    assert described[0] == "layer list traced from NanoGPT.forward (6 layers):" and "tok_emb" in described[1]


def test_resnet_pooling_and_flatten_give_the_same_gradients() -> None:
    model = SmallResNet().double()
    images, labels = next(iter(image_loader()))
    layers = traced_layers(model, _samples(images))
    assert layers.calls == [["stem"], ["stages.0"], ["stages.1"], ["stages.2"], ["pool"], ["fc"]]  # the Sequential is expanded
    assert "torch.flatten" in layers[4].code
    F.cross_entropy(model(images), labels).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(_chain(layers, images), labels).backward()
    assert all(torch.equal(p.grad, expected[name]) for name, p in model.named_parameters())


def test_values_alive_across_cuts_travel_as_a_tuple_and_masks_are_rebuilt() -> None:
    model = SkipMasked().double()
    idx = next(iter(token_loader()))[0]
    layers = traced_layers(model, _samples(idx))
    assert layers.calls == [["emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["head"]]
    passed = layers[0](idx)
    assert isinstance(passed, tuple) and [t.shape[0] for t in passed] == [len(idx)] * len(passed)  # all batch-first
    assert all("triu" in layers[i].code for i in (1, 2, 3)) and "triu" not in layers[0].code
    assert "tanh" in layers[4].code and [i for i, layer in enumerate(layers) if any(p is model.out_gain for p in layer.parameters())] == [4]
    assert torch.equal(_chain(layers, idx), model(idx))


def test_lightning_demo_transformer_is_cut_around_its_wrapper_and_nn_transformer() -> None:
    """``forward`` delegates to ``self.model`` (expanded); ``nn.Transformer`` with its
    data-dependent mask check stays one leaf; the embedding, called twice, keeps both calls
    in one layer; the (t, t) mask is built in the layer that uses it."""
    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=20).double().eval()
    inputs, target = torch.randint(0, 20, (4, 6)), torch.randint(0, 20, (4, 6))
    layers = traced_layers(model, _samples(inputs, target))
    assert layers.calls == [["model.embedding", "model.pos_encoder", "model.embedding"], ["model.pos_encoder"], ["model.transformer"], ["model.decoder"]]
    assert "triu" in layers[2].code and model.model.src_mask is None  # tracing left no placeholder behind
    assert torch.equal(_chain(layers, (inputs, target)), model(inputs, target))


class _EncoderWrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


def test_a_torch_module_called_alone_is_not_expanded() -> None:
    """Only the user's own wrappers are traced into: ``nn.TransformerEncoder``'s forward
    (with its fast-path checks on tensor values) stays one leaf."""
    x = torch.randn(4, 5, 8)
    assert traced_layers(_EncoderWrapper(), _samples(x)).calls == [["encoder"]]


def test_a_trace_failure_is_one_line_with_the_place_and_the_fix(tmp_path: Path) -> None:
    source, first = inspect.getsourcelines(Untraceable.forward)
    line = first + next(i for i, text in enumerate(source) if "the line the error must name" in text)
    x, y = next(iter(vector_loader()))
    with pytest.raises(DappleConfigError) as info:
        traced_layers(Untraceable().double(), _samples(x))
    message = str(info.value)
    assert "\n" not in message and message.count("Fix:") == 1
    assert f"traced_toys.py:{line}" in message and "control flow" in message and "if x.mean() > 0" in message
    assert "Fix: give the layer list by hand" in message and "layers='layers'" in message
    with pytest.raises(DappleConfigError, match=f"traced_toys.py:{line}"):  # through the strategy: before any step
        quiet_trainer(strategy=DappleStrategy(plan="auto", timeout_s=20), accelerator="cpu", devices=1, precision="64-true", max_steps=1, root=tmp_path).fit(
            Untraceable(), vector_loader()
        )


def test_a_forward_that_reads_self_training_is_refused() -> None:
    images = next(iter(image_loader()))[0]
    with pytest.raises(DappleConfigError, match="differently in training and evaluation mode"):
        traced_layers(ModeDependent().double(), _samples(images))


def test_a_head_tied_to_the_embedding_is_a_tie_between_traced_layers() -> None:
    model = TiedHead().double()
    idx = next(iter(token_loader()))[0]
    layers = find_layers(model, "layers", lambda: _samples(idx))  # no `layers` attribute: traced
    assert isinstance(layers, TracedLayers)
    check_parameters_in_layers(model, layers, "layers")  # allowed: a copy per holding stage
    assert [tie.layers for tie in tied_parameters(layers)] == [(0, 4)]


PLANS = {
    "straight-2 ooo": {"ooo": True, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, -1], "devices": [1]}]},
    "2x2 recompute": {"stages": [{"layers": [0, 2], "devices": [0, 1], "recompute": "always"}, {"layers": [2, -1], "devices": [2, 3]}]},
    "3-stage ooo": {"ooo": True, "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1]}, {"layers": [4, -1], "devices": [2]}]},
}
LAYER_COUNTS = {"nanogpt": 6, "resnet": 6, "skip": 5}


def _plan(name: str, model: str) -> dict:
    stages = [{**stage, "layers": [stage["layers"][0], LAYER_COUNTS[model] if stage["layers"][1] == -1 else stage["layers"][1]]} for stage in PLANS[name]["stages"]]
    return {"global_batch_size": 8, "micro_batches": 2, **PLANS[name], "stages": stages}


@pytest.mark.timeout(600)
def test_traced_layers_match_one_process_on_every_plan() -> None:
    cases = [(model, _plan(plan, model)) for model in ("nanogpt", "resnet", "skip") for plan in PLANS]
    results = run_ranks(run_traced_cases, 4, cases, timeout_s=500)
    assert "__errors__" not in results, results.get("__errors__")
    for index, (model, plan) in enumerate(cases):
        per_rank = [results[rank][index] for rank in range(4) if results[rank][index] is not None]
        assert len(per_rank) == sum(len(stage["devices"]) for stage in plan["stages"]), (model, plan)
        assert sum(res["keys"] for res in per_rank) >= 1
        for res in per_rank:
            assert res["layers"] == LAYER_COUNTS[model]
            assert res["difference"] <= 1e-10, (model, plan, res)


def _strategy_trainer(tmp_path: Path, plan, **kwargs):
    return quiet_trainer(
        strategy=DappleStrategy(plan=plan, start_method="spawn", timeout_s=90),
        accelerator="cpu",
        devices=2,
        precision="64-true",
        max_steps=3,
        root=tmp_path,
        **kwargs,
    )


@pytest.mark.timeout(600)
def test_nanogpt_on_two_stages_whose_cut_the_planner_chooses(tmp_path: Path) -> None:
    """A plan mapping with devices and no layers: "two stages, one process each"."""
    shape = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"devices": [0]}, {"devices": [1]}]}
    reference = plain_run(NanoGPT(), token_loader())
    model = NanoGPT().double()  # spawn: the parent's module receives rank 0's weights in its own dtype
    saved = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    _strategy_trainer(tmp_path, shape, callbacks=[saved], enable_checkpointing=True).fit(model, token_loader())
    plan = json.loads((tmp_path / "dapple_plan.json").read_text())
    assert plan["planner"] == "dapple-shape" and [stage["devices"] for stage in plan["stages"]] == [[0], [1]]
    cut = plan["stages"][0]["layers"][1]
    assert plan["stages"][0]["layers"] == [0, cut] and plan["stages"][1]["layers"] == [cut, 6] and 0 < cut < 6
    assert relative_difference(model.state_dict(), reference) <= 1e-10  # rank 0 holds the whole model again
    checkpoint = torch.load(next((tmp_path / "ckpt").iterdir()), weights_only=False)
    plain = NanoGPT().double()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the module's own keys
    assert relative_difference(plain.state_dict(), reference) <= 1e-10


@pytest.mark.timeout(600)
def test_tied_traced_layers_on_two_stages(tmp_path: Path) -> None:
    """The embedding on stage 0, the head that reads its weight on stage 1: each keeps a
    copy (tied weights), and training equals one process."""
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}
    reference = plain_run(TiedHead(), token_loader())
    model = TiedHead().double()
    _strategy_trainer(tmp_path, plan).fit(model, token_loader())
    assert relative_difference(model.state_dict(), reference) <= 1e-10
    assert model.head.weight is model.emb.weight  # rank 0: one parameter again


@pytest.mark.timeout(600)
def test_resnet_with_flatten_in_forward_on_two_stages(tmp_path: Path) -> None:
    plan = {"global_batch_size": 8, "micro_batches": 4, "stages": [{"layers": [0, 4], "devices": [0]}, {"layers": [4, 6], "devices": [1]}]}
    reference = plain_run(SmallResNet(), image_loader())
    model = SmallResNet().double()
    _strategy_trainer(tmp_path, plan, gradient_clip_val=None).fit(model, image_loader())
    assert relative_difference(model.state_dict(), reference) <= 1e-10



SCRIPT = Path(__file__).parent / "scripts" / "demo_transformer_with_dapple.py"


def _launch(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "DAPPLE_DEBUG")}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "out.json"), *extra], capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env
    )


@pytest.mark.timeout(600)
def test_lightning_demo_transformer_trains_on_two_stages_and_rank_zero_alone_prints(tmp_path: Path) -> None:
    result = _launch(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert not [line for line in output.splitlines() if "error" in line.lower() or "Traceback" in line], output[-3000:]
    assert output.count("layer list traced from OfflineTransformer.forward (4 layers):") == 1
    trained = json.loads((tmp_path / "out.json").read_text())
    assert trained["stages"][0][0] == 0 and trained["stages"][1][1] == 4 and len(trained["stages"]) == 2
    assert trained["changed"] == trained["keys"]  # every parameter took its steps, on whichever stage


@pytest.mark.timeout(600)
def test_an_untraceable_module_on_two_processes_prints_one_line(tmp_path: Path) -> None:
    result = _launch(tmp_path, "untraceable")
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("lightning_dapple: error: DappleConfigError: Untraceable.forward: cannot be traced")
    assert "traced_toys.py:" in errors[0] and "Fix: give the layer list by hand" in errors[0]


def test_command_lines_profile_and_plan_a_module_without_a_layer_sequence(tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    assert profile_cli.main(["--model", "traced_toys:nanogpt_with_example", "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
    assert "layer list traced from NanoGPT.forward (6 layers):" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["layers"]) == 6
    assert plan_cli.main(["--profile", str(out), "--cluster", "1x2", "--global-batch-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stages"][-1]["layers"][1] == 6
    assert plan_cli.main(["--model", "traced_toys:nanogpt_with_example", "--cluster", "1x2", "--global-batch-size", "8", "--json"]) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["stages"][-1]["layers"][1] == 6 and "6 layers" in printed.err
    assert plan_cli.main(["--model", "traced_toys:untraceable_with_example", "--cluster", "1x2", "--global-batch-size", "8"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: Untraceable.forward: cannot be traced") and "traced_toys.py:" in errors[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_traced_layers_follow_the_module_to_the_gpu(tmp_path: Path) -> None:
    """Setup moves the module to the GPU; the traced layers read the same tensors (the
    module's own ``pos_emb`` included), so they run there and train like one process."""
    reference = plain_run(NanoGPT(), token_loader())
    model = NanoGPT().double()
    plan = {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 6], "devices": [0]}]}
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan=plan, timeout_s=60), accelerator="gpu", devices=1, precision="64-true", max_steps=3, root=tmp_path
    )
    trainer.fit(model, token_loader())
    state = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    assert relative_difference(state, reference) <= 1e-10
