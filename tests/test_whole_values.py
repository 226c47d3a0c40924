"""Values that are not per-sample: rotary tables of shape (1, T, n), masks of shape
(1, 1, T, T) and 0-d tensors pass between stages whole (profile/sample_rows.py,
execute/transfer/transport.py), and the planner prices them once per micro-batch.

* the transport's round trip over every wire, forced over gloo on CPU: which sender's copy
  a receiver gets, what each sender gets back as the gradient, the bytes a sender leaves
  out, the one-row cases the transport settles, and the contradiction it refuses;
* a litgpt-shaped model (a rotary table, a causal mask from the batch and a learned
  position table that requires grad, passed to every block in a tuple) trained on 2x2,
  1:2:1 and 3:1 plans over the gloo, staged and nccl wires equals one process in float64;
* the profiler measures a cut's whole bytes, the cost model and the planner's tables add
  them unscaled, and old profile JSON still loads.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import run_ranks

WIRES = ("gloo", "staged", "nccl")
TABLE = (1, 4, 2)


# --------------------------------------------------------------------------- transport


def _rows(total: int, ranks: tuple[int, ...], rank: int) -> tuple[int, int]:
    from lightning_dapple.execute.slicing import row_range

    return row_range(total, len(ranks), ranks.index(rank))


def _sent(rank: int, total: int, rows: tuple[int, int], per_sample_table: bool = False) -> tuple:
    """What sender ``rank`` sends for rows ``rows`` of ``total``: per-sample h, a table and a
    0-d scale (whole, different on every sender so the receiver shows whose copy it took,
    both requiring grad) and a bool mask (whole)."""
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(total, 3, generator=gen, dtype=torch.float64)[rows[0] : rows[1]]
    table = torch.randn(*TABLE, generator=gen, dtype=torch.float64) + rank
    if per_sample_table:
        table = table.expand(rows[1] - rows[0], *TABLE[1:]).clone()
    scale = torch.tensor(2.0 + rank, dtype=torch.float64)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    return (h.requires_grad_(True), {"table": table.requires_grad_(True), "scale": scale.requires_grad_(True)}, mask)


def _returned(rank: int, total: int, rows: tuple[int, int], table_rows: int) -> list[torch.Tensor]:
    """The gradients receiver ``rank`` sends back (h's rows of a global one; its own for the
    table and the scale)."""
    gen = torch.Generator().manual_seed(11)
    gh = torch.randn(total, 3, generator=gen, dtype=torch.float64)[rows[0] : rows[1]]
    mine = torch.Generator().manual_seed(100 + rank)
    return [gh, torch.randn(table_rows, *TABLE[1:], generator=mine, dtype=torch.float64), torch.randn((), generator=mine, dtype=torch.float64)]


# (senders, receivers, rows of the micro-batch, how the receiver reads the table)
SCENARIOS = [
    ((0, 1), (2,), 6, "whole"),  # 2:1, both senders hold three rows: sender 0's copy
    ((0, 1), (2,), 6, "whole"),  # the same again: the layout is known, short messages
    ((0,), (1, 2), 6, "whole"),  # 1:2: both receivers get sender 0's, its gradient is the sum
    ((0, 1), (2,), 3, "whole"),  # rows 1 + 2: the one-row sender's row is the table, the other marks it whole
    ((0, 1, 2), (3,), 4, "whole"),  # rows 1 + 1 + 2: the second one-row sender gets zeros back
    ((0,), (1, 2), 2, "whole"),  # receivers of one row from a sender of two
    ((0, 1), (2,), 2, "rows"),  # every sender holds one row, the receiver two: per-sample, repeated
]


def _round_trip(rank: int, transport: Any, index: int, scenario: tuple) -> dict[str, Any]:
    """One activation transfer and its gradient; every side checks what it got and reports
    what differs (rather than raising, so every rank stays in step with its peers)."""
    from lightning_dapple.execute.transfer.transport import Peer

    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(f"scenario {index}, rank {rank}: {what}")

    senders, receivers, total, reading = scenario
    label = f"scenario {index}"
    if rank in senders:
        mine = _rows(total, senders, rank)
        before = transport.bytes_sent
        h, tables, mask = _sent(rank, total, mine)
        transport.send_activation((h, tables, mask), mine, [Peer(r, _rows(total, receivers, r)) for r in receivers], label)
        transport.flush()
        sent = transport.bytes_sent - before
        peers = [Peer(r, _rows(total, receivers, r)) for r in receivers]
        got = transport.recv_gradient([h, tables["table"], tables["scale"]], mine, peers, f"gradient {index}")
        want_h, want_table, want_scale = torch.zeros(0, 3, dtype=torch.float64), torch.zeros(TABLE, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        for r in receivers:
            theirs = _rows(total, receivers, r)
            lo, hi = max(mine[0], theirs[0]), min(mine[1], theirs[1])
            if hi <= lo:
                continue
            returned = _returned(r, total, theirs, 1 if reading == "whole" else theirs[1] - theirs[0])
            want_h = torch.cat([want_h, returned[0][lo - theirs[0] : hi - theirs[0]]])
            if reading == "rows":
                want_table = want_table + returned[1][lo - theirs[0] : hi - theirs[0]]
            elif lo == theirs[0]:  # this sender sent that receiver its first row
                want_table = want_table + returned[1]
            if lo == theirs[0]:
                want_scale = want_scale + returned[2]
        check(torch.equal(got[0], want_h), "h's gradient")
        check(got[1].shape == TABLE and torch.allclose(got[1], want_table, rtol=0, atol=1e-15), f"table's gradient {got[1]} != {want_table}")
        check(got[2].shape == () and torch.allclose(got[2], want_scale, rtol=0, atol=1e-15), "scale's gradient")
        return {"sent": sent, "problems": problems}
    if rank not in receivers:
        return {"problems": problems}
    mine = _rows(total, receivers, rank)
    peers = [Peer(r, _rows(total, senders, r)) for r in senders]
    h, tables, mask = transport.recv_activation(mine, peers, label)
    first = next(r for r in senders if _rows(total, senders, r)[0] <= mine[0] < _rows(total, senders, r)[1])
    check(torch.equal(h, _sent(0, total, mine)[0].detach()) and h.requires_grad, "h")
    repeats = 1 if reading == "whole" else mine[1] - mine[0]  # one-row senders: every (1, ...) leaf per-sample
    check(torch.equal(mask, _sent(0, total, mine)[2].expand(repeats, -1, -1, -1)), "mask")
    if reading == "whole":
        want = _sent(first, total, _rows(total, senders, first))[1]
        check(tables["table"].shape == TABLE and torch.equal(tables["table"], want["table"].detach()), f"table is not rank {first}'s")
        check(tables["scale"].shape == () and torch.equal(tables["scale"], want["scale"].detach()), f"scale is not rank {first}'s")
    else:  # one row from each sender: each one's table, one row apiece
        want_rows = torch.cat([_sent(r, total, _rows(total, senders, r))[1]["table"].detach() for r in senders])
        check(tables["table"].shape == (mine[1] - mine[0], *TABLE[1:]) and torch.equal(tables["table"], want_rows), "table rows")
        check(torch.equal(tables["scale"], _sent(first, total, _rows(total, senders, first))[1]["scale"].detach()), "scale")
    check(tables["table"].requires_grad and tables["scale"].requires_grad, "requires_grad")
    returned = _returned(rank, total, mine, tables["table"].shape[0])
    transport.send_gradient(returned, mine, peers, f"gradient {index}")
    transport.flush()
    return {"checked": True, "problems": problems}


def _contradiction(rank: int, transport: Any) -> str | None:
    """Two senders of two rows each, one marking the table whole and one per-sample: the
    receiver refuses it with a clear error."""
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.transfer.transport import Peer

    senders, total = (0, 1), 4
    if rank in senders:
        mine = _rows(total, senders, rank)
        transport.send_activation(_sent(rank, total, mine, per_sample_table=rank == 1), mine, [Peer(2, (0, total))], "contradiction")
        transport.flush()
        return None
    if rank != 2:
        return None
    with pytest.raises(DappleConfigError) as caught:
        transport.recv_activation((0, total), [Peer(r, _rows(total, senders, r)) for r in senders], "contradiction")
    return str(caught.value)


def transport_worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Transport

    failure = FailureChannel(rank, timeout_s=60)
    out: dict[str, Any] = {}
    for wire in WIRES:  # every rank builds every wire in the same order (nccl's is collective)
        transport = Transport(failure, torch.device("cpu"), wire=wire)
        out[wire] = [_round_trip(rank, transport, index, scenario) for index, scenario in enumerate(SCENARIOS)]
        out[wire + " error"] = _contradiction(rank, transport)
    return out


@pytest.mark.timeout(300)
def test_whole_values_round_trip_over_every_wire() -> None:
    results = run_ranks(transport_worker, 4, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for wire in WIRES:
        problems = [p for rank in range(4) for got in results[rank][wire] for p in got["problems"]]
        assert not problems, (wire, problems)
        for index, (senders, receivers, _, _) in enumerate(SCENARIOS):
            for rank in receivers:
                assert results[rank][wire][index]["checked"], (wire, index, rank)
        # a known layout (scenario 1): sender 0 sends its rows of h, the table (64 bytes), the
        # scale (8) and the mask (16); sender 1 holds no receiver's first row: its rows only
        h_rows = 3 * 3 * 8
        flag = 1 if wire == "nccl" else 0
        assert results[0][wire][1]["sent"] == h_rows + 64 + 8 + 16 + flag, (wire, results[0][wire][1])
        assert results[1][wire][1]["sent"] == h_rows + flag, (wire, results[1][wire][1])
        message = results[2][wire + " error"]
        assert "tensor 1 is per-sample on rank 1" in message and "whole on rank 0" in message, message


def test_a_tensor_neither_batch_first_nor_whole_is_refused_with_the_fix() -> None:
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.transfer.transport import _meta_of

    assert _meta_of(torch.zeros(1, 4, 2), 3).whole and _meta_of(torch.zeros(()), 1).whole
    assert not _meta_of(torch.zeros(1, 4, 2), 1).whole and not _meta_of(torch.zeros(3, 4, 2), 3).whole
    with pytest.raises(DappleConfigError, match="neither the batch .3 rows. nor 1.*first dimension of 1"):
        _meta_of(torch.zeros(4, 2), 3)


def test_batches_with_whole_values_are_cut_by_their_per_sample_rows() -> None:
    """A mask of shape (1, 1, T, T) first in the batch: the batch has the tokens' rows, and
    every micro-batch slice gets the mask as it is."""
    from lightning_dapple.execute.slicing import batch_size_of, take_rows

    mask, tokens, scale = torch.ones(1, 1, 5, 5, dtype=torch.bool), torch.arange(24).reshape(6, 4), torch.tensor(3.0)
    batch = {"mask": mask, "tokens": tokens, "scale": scale}
    assert batch_size_of(batch) == 6
    part = take_rows(batch, 2, 4)
    assert part["mask"] is mask and part["scale"] is scale and torch.equal(part["tokens"], tokens[2:4])
    assert batch_size_of((torch.zeros(1, 3), torch.zeros(1, 2))) == 1  # a batch of one row is one


# --------------------------------------------------------------------------- training


class Embed(nn.Module):
    """(tokens, mask) -> (h, rotary table (1, T, hs), mask (1, 1, T, T), position table
    (1, T, C) that requires grad): the tuple every block gets and passes on."""

    def __init__(self, vocab: int, width: int, length: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.1 * torch.randn(1, length, width))
        size = width // heads
        inverse = 1.0 / (10000 ** (torch.arange(0, size, 2, dtype=torch.float64) / size))
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inverse)
        self.register_buffer("rope", torch.cat([angles.cos(), angles.sin()], -1)[None], persistent=False)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        tokens, mask = inputs
        length = tokens.shape[1]
        return self.tokens(tokens), self.rope[:, :length], mask, self.position[:, :length]


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, heads, T, hs) by a table (1 or B, T, hs): cos | sin halves."""
    half = x.shape[-1] // 2
    cos, sin = rope[:, None, :, :half], rope[:, None, :, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, state: tuple) -> tuple:
        x, rope, mask, position = state
        rows, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x + position)).view(rows, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = (_rotate(q, rope) @ _rotate(k, rope).transpose(-1, -2)) / math.sqrt(width // self.heads)
        attended = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(rows, length, width))
        return x + self.mlp(self.norm2(x)), rope, mask, position


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, state: tuple) -> torch.Tensor:
        return self.linear(self.norm(state[0]))


VOCAB, WIDTH, LENGTH, HEADS, BLOCKS = 13, 8, 5, 2, 4
STEPS, LR = 3, 1e-2


def make_model() -> nn.Sequential:
    torch.manual_seed(4321)
    return nn.Sequential(Embed(VOCAB, WIDTH, LENGTH, HEADS), *[Block(WIDTH, HEADS) for _ in range(BLOCKS)], Head(WIDTH, VOCAB)).double()


def make_batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(causal mask (1, 1, T, T), tokens, targets): the mask first, so the batch's rows are
    found past it."""
    gen = torch.Generator().manual_seed(300 + step)
    tokens = torch.randint(0, VOCAB, (rows, LENGTH), generator=gen)
    targets = torch.randint(0, VOCAB, (rows, LENGTH), generator=gen)
    return torch.ones(1, 1, LENGTH, LENGTH, dtype=torch.bool).tril(), tokens, targets


class Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[1], batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        logits = forward(self.make_input(batch))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[2].reshape(-1))


def reference(rows: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """One process on the whole global batch: per-layer parameters after each run, losses."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        batch = make_batch(step, rows)
        opt.zero_grad()
        loss = Callbacks().compute_loss(batch, model)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return [{k: v.clone() for k, v in layer.state_dict().items()} for layer in model], losses


PLANS = {
    # 6 layers: embed, 4 blocks, head
    "2x2 hybrid": {
        "global_batch_size": 12, "micro_batches": 2,
        "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 6], "devices": [2, 3], "recompute": "always"}],
    },
    "1:2:1": {
        "global_batch_size": 12, "micro_batches": 2,
        "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1, 2]}, {"layers": [4, 6], "devices": [3]}],
    },
    # micro-batches of 4 rows over 3 replicas: slices 1, 1, 2 (the one-row senders settle
    # by the two-row one), into one replica
    "3:1 uneven": {
        "global_batch_size": 8, "micro_batches": 2,
        "stages": [{"layers": [0, 4], "devices": [0, 1, 2]}, {"layers": [4, 6], "devices": [3]}],
    },
    # micro-batches of 2 rows: the middle stage's replicas hold one row each, so the last
    # stage reads the tables per-sample (repeated); a model that broadcasts them is exact
    "1:2:1 one-row": {
        "global_batch_size": 6, "micro_batches": 3,
        "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [1, 2]}, {"layers": [4, 6], "devices": [3]}],
    },
}


def train_worker(rank: int, world: int) -> dict[str, Any]:
    """Every plan over every wire, three Adam steps each: the relative parameter difference
    from one process and the largest loss difference, per case."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    references: dict[int, Any] = {}
    out: dict[str, Any] = {}
    for name, data in PLANS.items():
        plan = plan_from_dict({**data, "schedule": "dapple"})
        groups = build_groups(plan)
        rows = plan.global_batch_size
        if rows not in references:
            references[rows] = reference(rows)
        ref_params, ref_losses = references[rows]
        stage = plan.stages[plan.stage_of_rank(rank)]
        for wire in WIRES:
            model = make_model()
            local = [model[i] for i in range(stage.start, stage.end)]
            runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, post_ahead=True, wire=wire, ties=())
            opt = torch.optim.Adam(runner.parameters, lr=LR)
            losses = []
            for step in range(STEPS):
                loss, _ = runner.train_step(make_batch(step, rows), Callbacks())
                opt.step()
                losses.append(float(loss))
            runner.finish()
            relative = max(
                float((value - ref_params[stage.start + offset][key]).norm() / ref_params[stage.start + offset][key].norm())
                for offset, layer in enumerate(local)
                for key, value in layer.state_dict().items()
            )
            out[f"{name} / {wire}"] = {"relative": relative, "loss": max(abs(a - b) for a, b in zip(losses, ref_losses))}
    return out


@pytest.mark.timeout(900)
def test_a_litgpt_shaped_model_with_whole_tables_equals_one_process() -> None:
    results = run_ranks(train_worker, 4, timeout_s=840)
    assert "__errors__" not in results, results.get("__errors__")
    cases = [f"{name} / {wire}" for name in PLANS for wire in WIRES]
    for rank in range(4):
        assert sorted(results[rank]) == sorted(cases)
        for case in cases:
            got = results[rank][case]
            assert got["relative"] <= 1e-10 and got["loss"] <= 1e-10, (rank, case, got)


# --------------------------------------------------------------------------- pricing


def _whole_profile(pbs: int = 2) -> Any:
    from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

    layers = [LayerProfile(f"l{i}", 1.0, 2.0, 1000.0, 1e6, 4000.0, output_whole_bytes=500.0 * (i + 1)) for i in range(4)]
    return ModelProfile(pbs, tuple(layers))


def test_cost_model_and_planner_tables_add_the_whole_bytes_unscaled() -> None:
    import numpy as np

    from lightning_dapple.cluster import Cluster
    from lightning_dapple.plan.costs import stage_costs
    from lightning_dapple.plan.plan import StagePlan
    from lightning_dapple.plan.search_tables import RangeTables

    profile, cluster = _whole_profile(pbs=2), Cluster(2, 2)
    stages = (StagePlan((0, 2), (0, 1)), StagePlan((2, 4), (2,)))
    for mbs in (8, 16):
        first, second = stage_costs(profile, cluster, stages, mbs)
        # the cut after layer 1: 1000 bytes per 2 samples, 1000 fixed bytes
        assert first.output_bytes == 1000.0 * mbs / 2 + 1000.0
        assert first.send_ms == cluster.p2p_ms(1000.0 * mbs / 2 + 1000.0, (0, 1), (2,))
        assert second.input_bytes == 1000.0 * mbs / 2 + 1000.0  # one replica: the whole slice
        # deferred W keeps each weighted layer's output gradient (its fixed part once)
        assert second.wgrad_bytes == 4000.0 * mbs / 2 * 2 + 1500.0 + 2000.0
    tables = RangeTables(profile)
    for scale in (1.0, 4.0, 8.0):
        assert list(tables.cut_bytes(np.arange(4), scale)) == [layer.cut_bytes(scale) for layer in profile.layers]
        assert [layer.cut_bytes(scale) for layer in profile.layers] == [1000.0 * scale + 500.0 * (i + 1) for i in range(4)]


def test_the_planners_search_prices_whole_bytes_as_the_cost_model_does() -> None:
    """Every plan the search keeps carries its formula latency; with whole bytes on the
    cuts it equals the cost model's for the same stages (a search that scaled them, or left
    them out, would differ on the pipelines)."""
    from lightning_dapple.cluster import Cluster
    from lightning_dapple.plan.dapple_planner import _run_searches, _to_stages, search_effort
    from lightning_dapple.plan.evaluate import score_stages
    from lightning_dapple.plan.partial import TopPlans
    from lightning_dapple.plan.request import PlanRequest
    from lightning_dapple.plan.search import SearchSettings
    from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

    layers = tuple(LayerProfile(f"l{i}", 1.0 + i % 2, 2.0, 2e5, 4e6, 1e6, output_whole_bytes=3e7 * (i % 2)) for i in range(6))
    profile, cluster = ModelProfile(1, layers), Cluster(2, 2, inter_bandwidth_gbps=10.0)
    request = PlanRequest.build(profile, cluster, 16, None, "dapple", "PA", None, 1, 4, None, None)
    keep_per_state, beam = search_effort(profile.num_layers, cluster.num_devices, None, None)
    top = TopPlans(64)
    _run_searches(request, request.tables, SearchSettings("PA", "dapple", keep_per_state, False, True, beam), top)
    pipelines = 0
    for latency, _, m, raw in top.items:
        stages = _to_stages(raw)
        official = score_stages(profile, cluster, stages, 16, m).latency_ms
        assert latency == pytest.approx(official, rel=1e-9), (stages, m, latency, official)
        pipelines += len(stages) > 1
    assert pipelines > 0


def test_profiler_measures_whole_output_bytes_and_old_profiles_still_load() -> None:
    from lightning_dapple.profile.model_profile import profile_from_dict
    from lightning_dapple.profile.profiler import profile_layers

    layers = make_model().float()
    tokens = torch.randint(0, VOCAB, (4, LENGTH))
    mask = torch.ones(1, 1, LENGTH, LENGTH, dtype=torch.bool)
    profile = profile_layers(layers, (tokens, mask), repeats=1, warmup=0)
    assert profile.micro_batch_size == 4
    hidden = 4 * LENGTH * WIDTH * 4
    whole = LENGTH * (WIDTH // HEADS) * 4 + LENGTH * LENGTH + LENGTH * WIDTH * 4  # rope, bool mask, position table
    for layer in profile.layers[:-1]:
        assert (layer.output_bytes, layer.output_whole_bytes) == (hidden, whole), layer
    assert profile.layers[-1].output_whole_bytes == 0
    again = profile_from_dict(profile.to_dict())
    assert [layer.output_whole_bytes for layer in again.layers] == [layer.output_whole_bytes for layer in profile.layers]
    old = profile.to_dict()
    assert [("output_whole_bytes" in entry) for entry in old["layers"]] == [True] * BLOCKS + [True, False]  # 0 is left out
    for entry in old["layers"]:
        entry.pop("output_whole_bytes", None)
    assert all(layer.output_whole_bytes == 0.0 for layer in profile_from_dict(old).layers)
