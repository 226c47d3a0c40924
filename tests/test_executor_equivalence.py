"""The executor gives the parameters of single-device training, for every plan and schedule.

Float64, Adam, global-norm gradient clipping active, 3 optimizer steps, compared with a
plain single-process run on the same global batches, to 1e-10.
"""
from __future__ import annotations

import pytest

from dist_harness import run_ranks
from equivalence_worker import make_batch, make_model, run_cases
from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.plan import plan_from_dict
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.simulate import simulate_plan

PLANS = {
    # layer counts: mlp has 5 layers, the transformer 5 (embed, 3 blocks, head)
    "straight-2": {"stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]},
    "dp-2": {"stages": [{"layers": [0, 5], "devices": [0, 1]}]},
    "2x2": {"stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}]},
    "3:1": {"stages": [{"layers": [0, 4], "devices": [0, 1, 2]}, {"layers": [4, 5], "devices": [3]}]},
    "3-stage": {"stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 4], "devices": [1]}, {"layers": [4, 5], "devices": [2]}]},
}


def _cases(micro_batches: int) -> list:
    cases = []
    for model in ("mlp", "transformer"):
        for plan in PLANS.values():
            for schedule in ("dapple", "gpipe"):
                cases.append((model, {"global_batch_size": 12, "micro_batches": micro_batches, **plan}, schedule))
    return cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_every_plan_and_schedule_matches_single_device(micro_batches: int) -> None:
    cases = _cases(micro_batches)
    results = run_ranks(run_cases, 4, cases, timeout_s=400)
    assert "__errors__" not in results, results.get("__errors__")
    names = [f"{m}/{name}/{s}" for m in ("mlp", "transformer") for name in PLANS for s in ("dapple", "gpipe")]
    for index, case_name in enumerate(names):
        per_rank = [results[r][index] for r in range(4) if results[r][index] is not None]
        assert per_rank, case_name
        for res in per_rank:
            assert res["param_diff"] < 1e-10, (case_name, res)
            assert res["loss_diff"] < 1e-10, (case_name, res)
            expected_peak = micro_batches if case_name.endswith("gpipe") else res["warmup"]
            assert res["peak_in_flight"] == expected_peak, (case_name, res)
    _check_stash_against_simulator(micro_batches, results)


@pytest.mark.timeout(600)
def test_policy_pb_warmups_match_single_device() -> None:
    """P_B's deeper warm-up (DAPPLE 5.3), which plan="auto" picks where it simulates faster:
    M = 4, K = [3, 1] on 2x2 and [4, 3, 1] on three stages."""
    names = ("2x2", "3-stage")
    cases = [(model, {"global_batch_size": 12, "micro_batches": 4, "policy": "PB", **PLANS[name]}, "dapple") for model in ("mlp", "transformer") for name in names]
    results = run_ranks(run_cases, 4, cases, timeout_s=400)
    assert "__errors__" not in results, results.get("__errors__")
    expected = {"2x2": [3, 3, 1, 1], "3-stage": [4, 3, 1]}
    for index, (model, plan_data, _) in enumerate(cases):
        name = names[index % len(names)]
        warmups = [results[r][index]["warmup"] for r in range(4) if results[r][index] is not None]
        assert warmups == expected[name], (model, name, warmups)
        for r in range(4):
            res = results[r][index]
            if res is not None:
                assert res["param_diff"] < 1e-10 and res["loss_diff"] < 1e-10, (model, name, res)
                assert res["peak_in_flight"] == res["warmup"], (model, name, res)


def _check_stash_against_simulator(micro_batches: int, results: dict) -> None:
    """The executor's measured peak stashed bytes equal the simulator's (profile stash x
    micro-batches in flight) where slices are even, so the profile scales exactly."""
    cases = _cases(micro_batches)
    profiles = {}
    for index, (model, plan_data, schedule) in enumerate(cases):
        plan = plan_from_dict({**plan_data, "schedule": schedule})
        if any(plan.micro_batch_size % stage.replicas for stage in plan.stages):
            continue
        if model not in profiles:
            layers = make_model(model)
            x = make_batch(model, 0)[0][: plan.micro_batch_size]
            profiles[model] = profile_layers(layers, x, repeats=1, warmup=0)
        sim = simulate_plan(plan, profiles[model], Cluster(1, 4))
        for rank in range(plan.world_size):
            stage = plan.stage_of_rank(rank)
            measured = results[rank][index]["peak_stash_bytes"]
            assert measured == pytest.approx(sim.stages[stage].peak_stash_bytes, rel=1e-9), (model, plan_data, schedule, rank)
