"""A tensor two consecutive layers save (a ``ReLU``'s output, the next ``Linear``'s input) is
stashed once on a stage: the executor meters a stage's layers together, and the profile
records each layer's ``stash_shared_bytes`` so that ``stash_span_bytes`` and the planner's
range tables count it once too. For every span of a small MLP, the profile's span stash
equals what the executor's meter counts for a stage holding that span, and both equal the
bytes counted by hand; for Hugging Face models kept whole, the two agree on every span of
their decoder blocks."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

from lightning_dapple.execute.stage import Stage
from lightning_dapple.plan.search_tables import RangeTables
from lightning_dapple.profile.model_profile import profile_from_dict, stash_span_bytes, validate_profile
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.profile.stash import StashMeter, parameter_storages
from lightning_dapple.errors import DappleConfigError

ROWS = 6
FLOAT64 = 8


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).double()


def _sample(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, 3, dtype=torch.float64)


def _metered(layers: Any, start: int, end: int, x: Any, rows: int = ROWS) -> int:
    """Bytes the executor's meter counts for one micro-batch of ``rows`` through a middle
    stage holding layers [start, end) (its input received from the stage before)."""
    stage_layers = [layers[i] for i in range(start, end)]
    stage = Stage(stage_layers, torch.device("cpu"), 1, 0, 3)
    stage.begin_step(torch.zeros(rows, 1), rows, [(0, rows)], None, 1.0, (0, 0))  # type: ignore[arg-type]  # a middle stage
    with torch.no_grad():
        for index in range(start):
            x = layers[index](x)
    stage.receive(0, tree_map(lambda t: t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x))
    meter = StashMeter(parameter_storages([p for layer in stage_layers for p in layer.parameters()]), rows=rows)
    stage.forward(0, meter)
    stage.end_step()
    return meter.bytes


@pytest.mark.parametrize("shape", [(ROWS,), (ROWS, 4)], ids=["2d", "3d"])
def test_span_stash_is_what_the_stage_meters(shape: tuple[int, ...]) -> None:
    """The 3-d case: ``Linear`` saves its input flattened, a reshape of the same memory as the
    ``ReLU`` output it is, which counts once as well."""
    model = _mlp()
    x = _sample(shape)
    profile = profile_layers(model, x, repeats=1, warmup=0)
    tokens = 1 if len(shape) == 1 else shape[1]
    widths = {0: 3, 1: 5, 2: 5, 3: 7, 4: 7}  # what each layer saves: its input (Linear) or its output (ReLU, Tanh)
    assert [layer.stash_bytes for layer in profile.layers] == [ROWS * tokens * widths[i] * FLOAT64 for i in range(5)]
    # the ReLU's output is the second Linear's input, the Tanh's output the last Linear's
    assert [layer.stash_shared_bytes for layer in profile.layers] == [0, 0, ROWS * tokens * 5 * FLOAT64, 0, ROWS * tokens * 7 * FLOAT64]
    tables = RangeTables(profile)
    for start in range(5):
        for end in range(start + 1, 6):
            by_hand = sum(widths[i] for i in range(start, end) if not (i > start and i in (2, 4))) * ROWS * tokens * FLOAT64
            span = stash_span_bytes(profile.layers[start:end], 1.0)
            assert span == by_hand, (start, end)
            assert tables.stash_bytes(start, end, 1.0) == span, (start, end)
            assert _metered(model, start, end, x) == by_hand, (start, end)


def test_a_profile_keeps_its_shared_stash_through_json_and_refuses_more_than_the_stash() -> None:
    profile = profile_layers(_mlp(), _sample((ROWS,)), repeats=1, warmup=0)
    data = profile.to_dict()
    assert profile_from_dict(data).layers[2].stash_shared_bytes == profile.layers[2].stash_shared_bytes > 0
    data["layers"][2]["stash_shared_bytes"] = data["layers"][2]["stash_bytes"] + 1
    with pytest.raises(DappleConfigError, match="stash_shared_bytes"):
        validate_profile(profile_from_dict(data))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_blocks_stash_on_a_stage_what_their_profile_says(kind: str) -> None:
    """GPT-2 and Llama kept whole (their layer list traced from the module's forward): the
    profile's span stash of every run of decoder blocks, per-sample and whole parts (Llama's
    rotary table) together, is what the executor's meter counts on a stage holding them."""
    pytest.importorskip("transformers")
    import hf_toys
    from lightning_dapple.strategy.module_adapter import find_layers

    model = hf_toys.LitLM(hf_toys.gpt2_config() if kind == "gpt2" else hf_toys.llama_config()).double()
    data = hf_toys.lm_batches(1)[0]
    args = tuple(data[key] for key in ("input_ids", "attention_mask", "labels"))
    layers = find_layers(model, "layers", lambda: [tuple(a[:1] for a in args), tuple(a[:2] for a in args)])
    rows = args[0].shape[0]
    profile = profile_layers(layers, args, repeats=1, warmup=0)
    blocks = range(1, len(layers) - 1)  # the embedding and the head around them
    assert all(profile.layers[index].stash_bytes > 0 for index in blocks)
    for start in blocks:
        for end in range(start + 1, blocks.stop + 1):
            assert _metered(layers, start, end, args, rows) == stash_span_bytes(profile.layers[start:end], 1.0), (start, end)


def test_a_table_each_layer_saves_and_passes_on_is_stashed_once_per_stage() -> None:
    """A litgpt-shaped stack: every rotary layer saves a view of the (1, T, n) table it
    receives and passes the table on. The profile records the table as the whole stash the
    layer before shares (``stash_shared_whole_bytes``), so every span's stash, in the profile
    and in the range tables, is what the executor's meter counts on a stage holding it: the
    table once, however many layers save it."""
    from test_whole_stash import B, N, T, _Embed, _Rotary

    torch.manual_seed(0)
    layers = nn.Sequential(_Embed(), _Rotary(), _Rotary(), _Rotary()).double()
    cache = torch.randn(1, 2 * T, N, dtype=torch.float64)
    sample = (torch.randn(B, T, N, dtype=torch.float64), cache[:, :T])
    profile = profile_layers(layers, sample, repeats=1, warmup=0)
    table = T * N * FLOAT64
    assert [layer.stash_shared_whole_bytes for layer in profile.layers] == [0, 0, table, table]
    tables = RangeTables(profile)
    for start in range(1, 4):
        for end in range(start + 1, 5):
            span = stash_span_bytes(profile.layers[start:end], 1.0)
            assert span == _metered(layers, start, end, sample, B), (start, end)
            assert tables.stash_bytes(start, end, 1.0) == span, (start, end)
    data = profile.to_dict()
    assert profile_from_dict(data).layers[3].stash_shared_whole_bytes == table
    data["layers"][3]["stash_shared_whole_bytes"] = data["layers"][3]["stash_whole_bytes"] + 1
    with pytest.raises(DappleConfigError, match="stash_shared_whole_bytes"):
        validate_profile(profile_from_dict(data))


def test_deferred_weight_gradients_keep_a_shared_table_once_per_stage() -> None:
    """Out-of-order backprop keeps each layer's stash until its deferred W (ooo-backprop
    sec. 3). Three rotary layers on one stage keep the table they save and pass on as one
    tensor, so the cost model's bytes between B and W are those of three stages of one
    layer each, less the two copies of the table that sharing saves."""
    from test_whole_stash import B, N, T, _Embed, _Rotary

    from lightning_dapple.cluster import Cluster
    from lightning_dapple.plan.costs import stage_costs
    from lightning_dapple.plan.plan import StagePlan

    torch.manual_seed(0)
    layers = nn.Sequential(_Embed(), _Rotary(), _Rotary(), _Rotary()).double()
    cache = torch.randn(1, 2 * T, N, dtype=torch.float64)
    profile = profile_layers(layers, (torch.randn(B, T, N, dtype=torch.float64), cache[:, :T]), repeats=1, warmup=0)
    table = T * N * FLOAT64
    cluster = Cluster(1, 4)
    joint = stage_costs(profile, cluster, (StagePlan((0, 1), (0,)), StagePlan((1, 4), (1,))), B)[1]
    apart = stage_costs(profile, cluster, tuple(StagePlan((i, i + 1), (i,)) for i in range(4)), B)[1:]
    assert joint.wgrad_bytes == sum(cost.wgrad_bytes for cost in apart) - 2 * table
