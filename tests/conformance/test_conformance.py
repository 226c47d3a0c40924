"""The conformance table: every user behaviour (``behaviours.py``) fitted under plain Lightning
on one process and under ``strategy="dapple"`` on each plan, and every observable compared:
parameters, optimizer state, checkpoint keys, ``callback_metrics`` and ``logged_metrics``,
the CSV logger's rows, the order of the batches, the files callbacks wrote, predictions,
and the warnings. A cell passes when everything is equal (float64, relative 1e-10), or when
what differs is the documented difference and its warning was given.

The plans share process groups: all 2-process plans run in one group, the 4-process plan in
another, each behaviour a fit of its own inside it (a process start costs seconds here). The
failing cells -- an error raised on one rank, the one line it prints under each launcher --
run as real launches in ``tests/test_strategy_reporting.py``.
``DAPPLE_CONFORMANCE=wide`` adds recomputation and out-of-order variants of every plan."""
from __future__ import annotations

import io
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.behaviours import BEHAVIOURS, fit_and_observe
from conformance.observe import differences
from lightning_dapple.execute.launch import ERRORS_KEY, run_ranks

TWO = [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]
PLANS: dict[str, dict[str, Any]] = {
    "one_stage_2_replicas": {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]},
    "two_stages": {"global_batch_size": 8, "micro_batches": 2, "stages": TWO},
    "chunked_interleaved": {
        "global_batch_size": 8, "micro_batches": 2, "schedule": "interleaved",
        "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 2], "devices": [1]}, {"layers": [2, 3], "devices": [0]}, {"layers": [3, 5], "devices": [1]}],
    },
    "hybrid_2x2": {"global_batch_size": 8, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}]},
}
if os.environ.get("DAPPLE_CONFORMANCE") == "wide":
    PLANS["two_stages_recompute_ooo"] = {"global_batch_size": 8, "micro_batches": 4, "ooo": True, "recompute": "always", "stages": TWO}
    PLANS["hybrid_2x2_recompute"] = {**PLANS["hybrid_2x2"], "recompute": "always", "ooo": False}


def _world(plan: dict[str, Any]) -> int:
    return len({rank for stage in plan["stages"] for rank in stage["devices"]})


def _cut(plan: dict[str, Any]) -> bool:
    """Whether the plan cuts each batch (micro-batches or last-stage replicas)."""
    return plan["micro_batches"] * len(plan["stages"][-1]["devices"]) > 1


def _fits(rank: int, world: int, plans: dict[str, dict], names: list[str], root: str) -> bytes:
    """Every (plan, behaviour) of this process group, fitted in turn (a worker); the
    observations as bytes (tensors through the queue would need this process alive)."""
    import io

    import torch

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))
    import lightning_dapple  # noqa: F401
    from lightning_dapple.strategy import DappleStrategy

    torch.manual_seed(100 + rank)  # what a script drew before fit may differ between ranks
    out = {}
    for plan_name, plan in plans.items():
        for name in names:
            out[(plan_name, name)] = fit_and_observe(
                BEHAVIOURS[name], os.path.join(root, plan_name, name), lambda: DappleStrategy(plan=plan, timeout_s=60), world
            )
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


@lru_cache(maxsize=None)
def _ours(world: int, root: Path) -> dict[tuple[str, str], Any]:
    plans = {name: plan for name, plan in PLANS.items() if _world(plan) == world}
    results = run_ranks(_fits, world, plans, list(BEHAVIOURS), str(root / "ours"), timeout_s=900)
    assert ERRORS_KEY not in results, results.get(ERRORS_KEY)
    return torch.load(io.BytesIO(results[0]), weights_only=False)


@lru_cache(maxsize=None)
def _plain(name: str, root: Path) -> dict[str, Any]:
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    previous = os.environ.get("PL_GLOBAL_SEED")
    rank_zero_only.rank = fabric_rank_zero.rank = 0  # the user's own process; an earlier test may have left another
    try:
        return fit_and_observe(BEHAVIOURS[name], str(root / "plain" / name), "auto", 1)
    finally:  # seed_everything leaves its seed in the environment
        if previous is None:
            os.environ.pop("PL_GLOBAL_SEED", None)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_a_fit_is_observed_as_under_plain_lightning(plan_name: str, name: str, root: Path) -> None:
    behaviour, plan = BEHAVIOURS[name], PLANS[plan_name]
    ours, plain = _ours(_world(plan), root)[(plan_name, name)], _plain(name, root)
    cut = _cut(plan)
    skipped = behaviour.differs_when_cut if cut else ()
    assert differences(ours, plain, skip_metrics=skipped) == []
    for metric in skipped:  # the documented difference: the slices' means combined by reduce_fx
        for stage, values in plain["metrics"].items():
            if metric in values:
                assert ours["metrics"][stage][metric] != pytest.approx(values[metric], rel=1e-6), (stage, metric)
    if behaviour.warns is not None:
        assert any(behaviour.warns in text for text in ours["warnings"]) == cut, ours["warnings"]
    assert not any("reduce_fx=" in text for text in plain["warnings"])
