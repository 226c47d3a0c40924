"""Blocks wrapped in ``torch.compile`` train like the plain blocks on a pipeline.

A compiled block runs its forward and backward as AOTAutograd programs, which neither the
deferred weight gradients of out-of-order backprop (their Linear modules run inside the
compiled program) nor recomputation (the forward runs again under checkpoint) may change:
float64, Adam with clipping, 3 steps on two stages, against the plain model trained in one
process, to 1e-10.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from equivalence_worker import CLIP, LR, STEPS, Callbacks, make_batch, make_model, reference_run
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.plan.plan import plan_from_dict

STRAIGHT = [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]
CASES = [(False, "never"), (True, "always")]  # plain; deferred weight gradients with a replayed forward


def _compiled_blocks(model: torch.nn.Sequential) -> torch.nn.Sequential:
    for index, layer in enumerate(model):
        if not isinstance(layer, torch.nn.Linear):  # the Blocks; the head stays plain
            model[index] = torch.compile(layer, backend="aot_eager")
    return model


def _train(rank: int, world: int, cases: list[tuple[bool, str]]) -> list[float]:
    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=60)
    reference, _, _ = reference_run("mlp")
    diffs = []
    for ooo, recompute in cases:
        stages = [{**stage, "recompute": recompute} for stage in STRAIGHT]
        plan = plan_from_dict({"global_batch_size": 12, "micro_batches": 3, "stages": stages, "ooo": ooo})
        groups = build_groups(plan)
        model = _compiled_blocks(make_model("mlp"))
        stage = plan.stages[plan.stage_of_rank(rank)]
        local = [model[i] for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device("cpu"), failure, groups=groups, ties=())
        optimizer = torch.optim.Adam(runner.parameters, lr=LR)
        for step in range(STEPS):
            runner.train_step(make_batch("mlp", step), Callbacks("mlp"))
            clip_grad_norm_global(runner.parameters, CLIP, stage.replicas, failure, group=groups.plan)
            optimizer.step()
        runner.finish()
        diff = 0.0
        for offset, layer in enumerate(local):
            for key, value in layer.state_dict().items():
                diff = max(diff, float((value - reference[stage.start + offset][key.removeprefix("_orig_mod.")]).abs().max()))
        diffs.append(diff)
    return diffs


@pytest.mark.timeout(300)
def test_compiled_blocks_on_two_stages_train_like_plain_blocks_with_ooo_and_recompute() -> None:
    results = run_ranks(_train, 2, CASES, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(2):
        for (ooo, recompute), diff in zip(CASES, results[rank]):
            assert diff < 1e-10, (rank, ooo, recompute, diff)


def test_a_compiled_block_keeps_its_backward_whole_and_a_plain_layer_beside_it_defers() -> None:
    """Out-of-order backprop routes plain Linear layers through the weight-gradient store,
    but not those inside a compiled block, whose compiled backward runs once, whole."""
    from lightning_dapple.execute.weight_grad import deferrable_modules

    plain = torch.nn.Linear(4, 4)
    inside = torch.nn.Linear(4, 4)
    layer = torch.nn.Sequential(plain, torch.compile(torch.nn.Sequential(inside, torch.nn.ReLU()), backend="aot_eager"))
    found = deferrable_modules(layer)
    assert plain in found and inside not in found
