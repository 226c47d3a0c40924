"""A recomputation mode fixed for every stage is priced by the planner: each candidate is
scored and simulated recomputing (gpipe.txt 2.3), so the plan's reason, its simulated
latency and the run's simulated step are one figure, the plan's as it runs."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.dapple_planner import plan_dapple
from lightning_dapple.profile.model_profile import profile_from_dict
from lightning_dapple.simulate.plan_and_schedule import simulate_plan
from lightning_dapple.strategy.auto_plan import run_finisher
from lightning_dapple.strategy.resolve import PlanArguments

PROFILE = profile_from_dict(json.loads((Path(__file__).parent / "data" / "vgg_tiny_profile.json").read_text()))
CLUSTER = Cluster(1, 4, shared_cores=None, latency_ms=0.2, allreduce_latency_ms=0.7, allreduce_latency_per_rank_ms=2.7)


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_every_figure_of_a_recomputing_plan_is_its_simulated_step(mode: str) -> None:
    plan = plan_dapple(PROFILE, CLUSTER, 64, simulate=simulate_plan, recompute=mode)
    assert {stage.recompute for stage in plan.stages} == {mode}
    simulated = simulate_plan(plan, PROFILE, CLUSTER).latency_ms
    assert plan.predicted is not None and plan.predicted.simulated_latency_ms == pytest.approx(simulated)
    # the reason quotes the chosen plan's step per step, as simulated with recomputation
    quoted = re.findall(r"([0-9.]+)(?: vs [0-9.]+)? ms per step", plan.reason)  # "A vs B ms per step": A is the chosen plan's
    assert f"{simulated:.1f}" in quoted, plan.reason
    # and recomputing costs the extra forward: the same stages without it simulate faster
    # (under except_last a single stage is the last one, which keeps its stash)
    plain = replace(plan, stages=tuple(replace(stage, recompute="never") for stage in plan.stages))
    if mode == "always" or len(plan.stages) > 1:
        assert simulate_plan(plain, PROFILE, CLUSTER).latency_ms < simulated
    else:
        assert simulate_plan(plain, PROFILE, CLUSTER).latency_ms == simulated


def test_the_run_finishes_every_candidate_with_the_users_mode() -> None:
    """``run_finisher`` (the planner's schedule choice and the tuning candidates use it) sets
    the fixed mode on any plan it finishes, so a candidate is priced as the run executes it."""
    unfinished = plan_dapple(PROFILE, CLUSTER, 64, simulate=simulate_plan)
    assert {stage.recompute for stage in unfinished.stages} == {"never"}
    finished = run_finisher(PlanArguments(recompute="always", ooo=False), PROFILE, CLUSTER)(unfinished)
    assert {stage.recompute for stage in finished.stages} == {"always"}


def test_a_mode_the_planner_cannot_price_is_refused() -> None:
    with pytest.raises(DappleConfigError, match="recompute: is 'auto'"):
        plan_dapple(PROFILE, CLUSTER, 64, simulate=simulate_plan, recompute="auto")
