"""The stash of values that are not per-sample counts once per slice.

A layer that saves a (1, T, n) table (or a view of it) for backward keeps one copy per
micro-batch slice whatever the slice's rows, so the profiler splits each layer's stash into
the per-sample part and the whole part (``sample_rows``), and every consumer prices a slice's
stash as the per-sample part scaled plus the whole part once (``stash_span_bytes``).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.activation_memory import with_activation_memory
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.profile.profiler import profile_layers

B, T, N = 3, 5, 4
F64 = 8  # bytes of a float64


class _Embed(nn.Module):
    """Per-sample projection; passes the table on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, table = x
        return self.proj(h), table


class _Rotary(nn.Module):
    """Multiplies by a squeezed view of the (1, T, n) table (saved: a (T, n) view of the
    whole input) and adds a mask built inside, of shape (1, T, n) (saved by the multiply
    after it: whole by shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(N, N)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, table = x
        y = self.proj(h) * table.squeeze(0)  # saves proj(h) (per-sample) and the (T, n) view
        scale = torch.ones(1, T, N, dtype=h.dtype) * 2.0  # made inside: whole by its shape
        return torch.tanh(y * scale), table  # mul saves scale (y's gradient); tanh saves its result


def _profile() -> ModelProfile:
    torch.manual_seed(0)
    layers = nn.Sequential(_Embed(), _Rotary()).double()
    cache = torch.randn(1, 2 * T, N, dtype=torch.float64)  # a rotary cache longer than the sequence
    sample = (torch.randn(B, T, N, dtype=torch.float64), cache[:, :T])
    return profile_layers(layers, sample, repeats=1, warmup=0)


def test_profiler_splits_the_stash_into_per_sample_and_whole_bytes() -> None:
    profile = _profile()
    per_row = B * T * N * F64  # one (B, T, n) float64 tensor
    table = T * N * F64  # the (1, T, n) table or a (1, T, n) tensor made inside
    embed, rotary = profile.layers
    # Linear saves its input h: per-sample; the table passes through unsaved
    assert (embed.stash_bytes, embed.stash_whole_bytes) == (per_row, 0)
    # per-sample: Linear's input, proj(h), tanh's result; whole: the table (once, through
    # its squeezed view, its own bytes and not its cache's) and the scale made inside
    assert (rotary.stash_bytes, rotary.stash_whole_bytes) == (3 * per_row, 2 * table)
    assert (profile.input_bytes, profile.input_whole_bytes) == (per_row, table)
    assert rotary.stash_for(2.0) == 6 * per_row + 2 * table


def _layers(stash: float, whole: float, count: int = 3) -> tuple[LayerProfile, ...]:
    return tuple(
        LayerProfile(f"l{i}", 1.0, 2.0, output_bytes=64.0, param_bytes=128.0, stash_bytes=stash * (i + 1), stash_whole_bytes=whole)
        for i in range(count)
    )


def test_cost_model_scales_only_the_per_sample_stash() -> None:
    profile = ModelProfile(micro_batch_size=4, layers=_layers(1000.0, 96.0), input_bytes=400.0, input_whole_bytes=48.0)
    cluster = Cluster(1, 2)
    stages = (StagePlan((0, 2), (0,)), StagePlan((2, 3), (1,)))
    by_size = {mbs: stage_costs(profile, cluster, stages, mbs) for mbs in (4, 8)}
    for mbs, scale in ((4, 1.0), (8, 2.0)):
        first, second = by_size[mbs]
        assert first.stash_bytes == (1000.0 + 2000.0) * scale + 2 * 96.0
        assert second.stash_bytes == 3000.0 * scale + 96.0
        assert first.input_bytes == 400.0 * scale + 48.0  # the model input's whole part once too
    # the search tables price every range as the cost model does, bit for bit
    tables = RangeTables(profile)
    for a, b in ((0, 2), (2, 3), (0, 3)):
        for mbs in (4, 8, 12):
            (cost,) = stage_costs(profile, Cluster(1, 1), (StagePlan((a, b), (0,)),), mbs)
            expected = sum(layer.stash_bytes for layer in profile.layers[a:b]) * (mbs / 4) + 96.0 * (b - a)
            assert cost.stash_bytes == tables.stash_bytes(a, b, mbs / 4) == expected


def test_deferred_weight_work_keeps_the_larger_whole_part_once() -> None:
    layers = (LayerProfile("a", 1.0, 2.0, 64.0, 128.0, 32.0, backward_input_ms=1.0, output_whole_bytes=16.0, stash_whole_bytes=40.0),)
    profile = ModelProfile(micro_batch_size=2, layers=layers)
    for mbs, scale in ((2, 1.0), (4, 2.0)):
        (cost,) = stage_costs(profile, Cluster(1, 1), (StagePlan((0, 1), (0,)),), mbs)
        assert cost.wgrad_bytes == 64.0 * scale + 40.0


def test_activation_memory_scales_the_per_sample_stash_only() -> None:
    profile = ModelProfile(micro_batch_size=2, layers=_layers(100.0, 50.0, count=2))
    scaled = with_activation_memory(profile, 600.0, "test")
    assert [layer.stash_bytes for layer in scaled.layers] == [400.0, 800.0]  # 600 x 2 rows over 100 + 200
    assert [layer.stash_whole_bytes for layer in scaled.layers] == [50.0, 50.0]


def test_profile_json_round_trips_and_old_profiles_load() -> None:
    old = {
        "micro_batch_size": 2,
        "input_bytes": 64,
        "layers": [{"name": "a", "forward_ms": 1, "backward_ms": 2, "output_bytes": 8, "param_bytes": 4, "stash_bytes": 16}],
    }
    loaded = profile_from_dict(json.loads(json.dumps(old)))
    assert (loaded.layers[0].stash_whole_bytes, loaded.input_whole_bytes) == (0.0, 0.0)
    assert "stash_whole_bytes" not in loaded.to_dict()["layers"][0] and "input_whole_bytes" not in loaded.to_dict()
    profile = _profile()
    again = profile_from_dict(json.loads(profile.to_json()))
    assert again.layers == profile.layers and again.input_whole_bytes == profile.input_whole_bytes > 0
    bad = json.loads(json.dumps(old))
    bad["layers"][0]["stash_whole_bytes"] = -1
    with pytest.raises(DappleConfigError, match="stash_whole_bytes"):
        profile_from_dict(bad)
    bad = {**old, "input_whole_bytes": "x"}
    with pytest.raises(DappleConfigError, match="input_whole_bytes"):
        profile_from_dict(bad)
