"""Layer-by-layer profiler and the dapple-profile CLI, on tiny CPU models."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_dapple.cli.profile import main
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile import load_profile
from lightning_dapple.profile.profiler import profile_layers

FAST = {"repeats": 2, "warmup": 1}


class Counting(nn.Module):
    """A Linear that counts its forward calls."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


class SplitTuple(nn.Module):
    """Tensor -> (hidden, integer positions): the second travels without needing a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), torch.arange(x.shape[0])


class TupleToDict(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, positions = pair
        return {"h": torch.tanh(hidden), "pos": positions}


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(batch["h"])


def test_linear_param_and_stash_bytes() -> None:
    profile = profile_layers(nn.Sequential(nn.Linear(64, 64)), torch.randn(8, 64), **FAST)
    layer = profile.layers[0]
    assert layer.param_bytes == (64 * 64 + 64) * 4
    saved_input = 8 * 64 * 4
    assert layer.stash_bytes >= saved_input
    assert layer.stash_bytes < saved_input + 64 * 64 * 4  # the weight is not stash
    assert layer.output_bytes == 8 * 64 * 4
    assert profile.micro_batch_size == 8
    assert profile.input_bytes == 8 * 64 * 4
    assert layer.forward_ms > 0 and layer.backward_ms > 0
    assert layer.backward_input_ms > 0 and layer.backward_weight_ms > 0
    assert layer.backward_input_ms + layer.backward_weight_ms > 0


def test_tuple_and_dict_outputs_are_passed_as_one_argument() -> None:
    layers = nn.Sequential(SplitTuple(), TupleToDict(), DictHead())
    profile = profile_layers(layers, torch.randn(5, 16), **FAST)
    split, to_dict, head = profile.layers
    assert split.output_bytes == 5 * 16 * 4 + 5 * 8  # float hidden + int64 positions
    assert to_dict.output_bytes == 5 * 16 * 4 + 5 * 8
    assert head.output_bytes == 5 * 4 * 4
    assert to_dict.param_bytes == 0 and to_dict.weight_grad_ms == 0
    assert to_dict.stash_bytes >= 5 * 16 * 4  # tanh keeps its output
    assert [layer.name for layer in profile.layers] == ["0 (SplitTuple)", "1 (TupleToDict)", "2 (DictHead)"]
    assert profile.to_dict()["layers"][0]["backward_input_ms"] >= 0


def test_an_in_place_activation_as_its_own_layer_is_timed_on_a_copy_of_its_input() -> None:
    """VGG-style stacks make nn.ReLU(inplace=True) a layer of its own: it cannot write the
    leaf the profiler times its backward from, so it gets a copy, as in the executor."""
    layers = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    profile = profile_layers(layers, torch.randn(4, 1, 6, 6), **FAST)
    assert profile.num_layers == 4 and profile.layers[1].output_bytes == 4 * 4 * 6 * 6 * 4


@pytest.mark.timeout(300)
def test_a_compiled_layer_is_profiled_with_its_whole_backward_as_b() -> None:
    """A torch.compile'd block's backward donates its buffers: it runs once per forward, so
    B and W cannot be timed apart; its whole backward is timed as B."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))), nn.Linear(8, 2))
    profile = profile_layers(layers, torch.randn(4, 8), **FAST)
    compiled = profile.layers[1]
    assert compiled.backward_input_ms == compiled.backward_ms > 0 and compiled.backward_weight_ms == 0.0


def test_integer_input_has_no_input_gradient() -> None:
    layers = [nn.Embedding(10, 8), nn.Linear(8, 2)]
    profile = profile_layers(layers, torch.randint(0, 10, (4, 3)), **FAST)
    embed = profile.layers[0]
    assert embed.backward_input_ms == 0
    assert embed.backward_weight_ms > 0
    assert embed.stash_bytes >= 4 * 3 * 8  # the saved indices
    assert profile.micro_batch_size == 4


def test_cache_hit_runs_no_forward(tmp_path) -> None:
    layers = nn.Sequential(Counting(), Counting())
    sample = torch.randn(4, 16)
    first = profile_layers(layers, sample, cache_dir=tmp_path, **FAST)
    calls = [layer.calls for layer in layers]
    assert all(count > 0 for count in calls)
    second = profile_layers(layers, sample, cache_dir=tmp_path, **FAST)
    assert [layer.calls for layer in layers] == calls
    assert second.layers == first.layers
    assert second.meta["cache"] == "hit"
    profile_layers(layers, torch.randn(6, 16), cache_dir=tmp_path, **FAST)  # new sample size: a miss
    assert all(layer.calls > count for layer, count in zip(layers, calls))


def test_buffers_and_rng_restored() -> None:
    norm = nn.BatchNorm1d(16)
    before = norm.running_mean.clone()
    sample = torch.randn(4, 16) + 3
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    profile_layers([nn.Dropout(0.5), norm], sample, **FAST)
    assert torch.equal(norm.running_mean, before)
    assert torch.equal(torch.rand(1), expected)


def test_bad_layers_name_the_layer() -> None:
    class TwoArgs(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    with pytest.raises(DappleConfigError) as info:
        profile_layers([nn.Identity(), TwoArgs()], (torch.randn(2, 3), torch.randn(2, 3)), **FAST)
    assert info.value.field == "layers[1] (TwoArgs)"
    with pytest.raises(DappleConfigError, match="single"):
        profile_layers(nn.Linear(2, 2), torch.randn(2, 2))
    with pytest.raises(DappleConfigError, match="no tensor"):
        profile_layers([nn.Identity()], {"a": 1})


# --------------------------------------------------------------------------- CLI


class TinyNet(nn.Module):
    """What `dapple-profile --model test_profiler:TinyNet --layers body.blocks` profiles."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        self.example_input_array = torch.randn(3, 8)


def make_tiny() -> nn.Module:
    return TinyNet()


class NoExample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2))


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_writes_profile(tmp_path, capsys) -> None:
    out = tmp_path / "sub" / "profile.json"
    code, stdout, _ = _run(
        ["--model", f"{__name__}:make_tiny", "--layers", "body.blocks", "--batch-size", "5",
         "--repeats", "1", "--warmup", "0", "--out", str(out)],
        capsys,
    )
    assert code == 0
    assert "wrote" in stdout and "Linear" in stdout
    data = json.loads(out.read_text())
    assert data["micro_batch_size"] == 5 and data["name"] == "make_tiny"
    profile = load_profile(out)
    assert profile.num_layers == 3
    assert profile.layers[0].param_bytes == (8 * 8 + 8) * 4


def make_lightning() -> nn.Module:
    """A factory returning a LightningModule (lightning is imported only by the test that needs it)."""
    import lightning.pytorch as pl

    class TinyLightning(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
            self.example_input_array = torch.randn(2, 4)

    return TinyLightning()


@pytest.mark.parametrize("model", ["TinyNet", "make_lightning"])
def test_cli_class_and_lightning_module(tmp_path, capsys, model: str) -> None:
    out = tmp_path / "p.json"
    layers = ["--layers", "body.blocks"] if model == "TinyNet" else []
    code, _, _ = _run(["--model", f"{__name__}:{model}", *layers, "--repeats", "1", "--warmup", "0", "--out", str(out)], capsys)
    assert code == 0
    assert load_profile(out).micro_batch_size == (3 if model == "TinyNet" else 2)


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("no_such_pkg.models:make", "cannot import module 'no_such_pkg.models'"),
        (f"{__name__}:missing_factory", "has no attribute 'missing_factory'"),
        ("just_a_module", "pkg.module:factory"),
        (f"{__name__}:NoExample", "example_input_array"),
    ],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, model: str, words: str) -> None:
    out = tmp_path / "p.json"
    code, _, err = _run(["--model", model, "--out", str(out)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert words in lines[0]
    assert "Traceback" not in err
    assert not out.exists()


def test_cli_bad_layers_attribute(tmp_path, capsys) -> None:
    code, _, err = _run(["--model", f"{__name__}:TinyNet", "--layers", "body.nope", "--out", str(tmp_path / "p.json")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "body.nope" in err


def test_autocast_profile_measures_the_mixed_precision_layers(tmp_path) -> None:
    """Under bf16 autocast a Linear's output is bfloat16: half the bytes a stage boundary
    sends; the cache keeps fp32 and bf16 profiles apart."""
    layers = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    full = profile_layers(layers, x, repeats=1, warmup=0, cache_dir=tmp_path)
    mixed = profile_layers(layers, x, repeats=1, warmup=0, cache_dir=tmp_path, autocast_dtype=torch.bfloat16)
    assert [l.output_bytes for l in full.layers] == [4 * 32 * 4, 4 * 8 * 4]
    assert [l.output_bytes for l in mixed.layers] == [4 * 32 * 2, 4 * 8 * 2]
    assert mixed.meta.get("cache") != "hit" and mixed.meta["autocast"] == "torch.bfloat16"
    assert all(p.dtype == torch.float32 for p in layers.parameters())
