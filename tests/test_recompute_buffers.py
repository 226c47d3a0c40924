"""Recomputation leaves buffers as a run without it leaves them (execute/replay.py).

gpipe.txt 2.3: a recomputed micro-batch's forward is replayed right before its backward.
BatchNorm updates its running statistics (and ``num_batches_tracked``) in every training
forward, so the replay must update scratch copies: the real buffers are updated once per
micro-batch, by its first forward, and autograd's saved running statistics keep their
version (writing old values back in place made every later backward fail). The buffers
are looked up when the replay runs: a dtype or device move after the stage was built
replaces the buffer tensors.

In one spawned group of two gloo ranks: a one-stage and a two-stage plan (BatchNorm on
both stages, one with ``momentum=None``, whose cumulative average reads
``num_batches_tracked``), M = 2, the layers moved to float32, float64 or bfloat16 after the
runner was built, recompute ``always`` and ``except_last``, with and without out-of-order
backprop. After 3 Adam steps every buffer and parameter equals ``recompute="never"``
exactly, and in float64 a single-process run over the same micro-batches to 1e-10. The
Trainer cases run the same through Lightning's precision plugins on one process.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_dapple  # noqa: F401  (registers the strategies)
from dist_harness import run_ranks
from lightning_dapple.execute.replay import buffer_slots, scratch_buffers
from lightning_dapple.strategy import DappleStrategy
from lightning_toys import MLPModule, mlp_loader, quiet_trainer
from ooo_worker import with_options

STEPS = 3
LR = 1e-2
ROWS = 12
ONE_STAGE = {"global_batch_size": ROWS, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}]}
TWO_STAGES = {
    "global_batch_size": ROWS,
    "micro_batches": 2,
    "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 3], "devices": [1]}],
}
PLANS = {"one-stage": ONE_STAGE, "two-stage": TWO_STAGES}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MODES = ("never", "always", "except_last")


class NormBlock(nn.Module):
    """Linear -> BatchNorm1d -> tanh; ``momentum=None`` averages over ``num_batches_tracked``.
    The linear layer has no bias: BatchNorm subtracts it again, so its gradient would be
    rounding noise, which Adam scales up to the size of a real update."""

    def __init__(self, width_in: int, width_out: int, momentum: float | None) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out, bias=False)
        self.norm = nn.BatchNorm1d(width_out, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.linear(x)))


def norm_layers() -> nn.Sequential:
    """Built in float32, as a module is before Lightning's precision plugin converts it."""
    torch.manual_seed(7)
    return nn.Sequential(NormBlock(6, 10, 0.1), NormBlock(10, 8, None), nn.Linear(8, 3))


def norm_batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, 6, generator=g).to(dtype), torch.randn(ROWS, 3, generator=g).to(dtype)


class _Callbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        return F.mse_loss(forward(batch[0]), batch[1])


def _state(layers: list[nn.Module], start: int) -> dict[str, list]:
    """Every parameter and buffer as plain lists (tensors in the result queue would outlive
    their sender's shared memory), keyed by global layer index."""
    return {f"{start + i}.{k}": v.detach().double().reshape(-1).tolist() for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}


def micro_batched_reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list]:
    """float64 on one process without a pipeline: each batch runs its two micro-batches one
    after the other (BatchNorm sees the same rows, in the same order, as on the stages),
    each loss weighted by its share of the batch, then one Adam step."""
    model = norm_layers().double()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches:
        half = len(x) // 2
        opt.zero_grad()
        for rows in (slice(0, half), slice(half, len(x))):
            (F.mse_loss(model(x[rows]), y[rows]) * (half / len(x))).backward()
        opt.step()
    return _state(list(model), 0)


def train_cases(rank: int, world: int, cases: list[tuple[str, str, str, bool]]) -> list[dict[str, list] | None]:
    """Per case (plan, dtype, recompute, ooo): this rank's parameters and buffers after
    ``STEPS`` steps (None where the rank is not in the plan). The layers move to the dtype
    after the runner is built, as the strategy moves a stage to its device after that."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    failure = FailureChannel(rank, timeout_s=60)
    groups = {name: build_groups(plan_from_dict(data)) for name, data in PLANS.items()}  # collectives: every rank, same order
    out: list[dict[str, list] | None] = []
    for plan_name, dtype_name, recompute, ooo in cases:
        plan = plan_from_dict(with_options(PLANS[plan_name], "dapple", ooo, recompute))
        if rank >= plan.world_size:
            out.append(None)
            continue
        stage = plan.stages[plan.stage_of_rank(rank)]
        model = norm_layers()
        local = [model[i] for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups[plan_name], ties=())
        for layer in local:
            layer.to(DTYPES[dtype_name])
        opt = torch.optim.Adam(runner.parameters, lr=LR)
        for step in range(STEPS):
            runner.train_step(norm_batch(step, DTYPES[dtype_name]), _Callbacks())
            opt.step()
        runner.finish()
        out.append({**_state(local, stage.start), "recomputed": [runner.stats.recomputed]})
    return out


@pytest.mark.timeout(300)
def test_recomputation_updates_buffers_once_and_keeps_the_gradients() -> None:
    cases = [(plan, dtype, mode, ooo) for plan in PLANS for dtype in DTYPES for mode in MODES for ooo in (False, True)]
    results = run_ranks(train_cases, 2, cases, timeout_s=280, raise_on_error=True)
    reference = micro_batched_reference([norm_batch(step, torch.float64) for step in range(STEPS)])
    index = {case: i for i, case in enumerate(cases)}
    checked = 0
    for (plan, dtype, mode, ooo), i in index.items():
        never = index[(plan, dtype, "never", ooo)]
        for rank in (0, 1):
            got, base = results[rank][i], results[rank][never]
            if got is None:
                continue
            if mode == "always":  # the replay really ran (the one-stage plan: both micro-batches)
                assert got["recomputed"][0] > 0, (plan, dtype, mode, ooo, rank)
            assert got.keys() == base.keys()
            for key in got:
                if key != "recomputed":
                    assert got[key] == base[key], (plan, dtype, mode, ooo, rank, key)
            if dtype == "float64":
                for key, value in got.items():
                    if key != "recomputed":
                        gap = max(abs(a - b) for a, b in zip(value, reference[key]))
                        assert gap < 1e-10, (plan, mode, ooo, rank, key, gap)
            checked += 1
    assert checked == len(cases) * 3 // 2  # one-stage cases on rank 0, two-stage on both ranks
    # the buffers that moved to float64 after the runner was built count each micro-batch once
    moved = results[0][index[("one-stage", "float64", "always", False)]]
    assert moved["0.norm.num_batches_tracked"] == moved["1.norm.num_batches_tracked"] == [2 * STEPS]


def test_a_replay_writes_scratch_copies_only() -> None:
    """Inside ``scratch_buffers`` the layers' buffers are copies (a module reached through
    two layers is swapped once); leaving puts the very same tensors back, unwritten."""
    norm = nn.BatchNorm1d(4)
    shared = nn.Sequential(nn.Linear(4, 4), norm)
    layers = [shared, nn.Sequential(norm, nn.Tanh())]
    slots = buffer_slots(layers)
    assert [name for _, name in slots] == ["running_mean", "running_var", "num_batches_tracked"]
    norm.to(torch.float64)  # a move after the slots were found replaces the tensors
    before = {name: (buffer, buffer._version, buffer.clone()) for name, buffer in norm.named_buffers()}
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    with scratch_buffers(slots):
        out = norm(x)
        inside = dict(norm.named_buffers())
        assert all(inside[name] is not tensor for name, (tensor, _, _) in before.items())
        assert int(inside["num_batches_tracked"]) == 1
    for name, buffer in norm.named_buffers():
        tensor, version, value = before[name]
        assert buffer is tensor and buffer._version == version and torch.equal(buffer, value), name
    out.sum().backward()  # the saved statistics are the copies: no in-place error


class NormModule(MLPModule):
    """The Trainer form of ``norm_layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = norm_layers()


def _fit(tmp_path: Path, precision: str, recompute: str) -> dict[str, torch.Tensor]:
    model = NormModule()
    dtype = {"64-true": torch.float64, "bf16-true": torch.bfloat16}.get(precision, torch.float32)
    strategy = DappleStrategy(plan=ONE_STAGE, recompute=recompute, ooo=False, timeout_s=60)
    trainer = quiet_trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, precision=precision, root=tmp_path)
    trainer.fit(model, mlp_loader(STEPS, dtype=dtype))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-true"])
def test_trainer_recomputation_with_batch_norm_equals_never(tmp_path: Path, precision: str) -> None:
    never = _fit(tmp_path / "never", precision, "never")
    always = _fit(tmp_path / "always", precision, "always")
    assert never.keys() == always.keys() and "layers.0.norm.running_mean" in never
    for key in never:
        assert torch.equal(never[key], always[key]), key
    assert int(always["layers.1.norm.num_batches_tracked"]) == 2 * STEPS
