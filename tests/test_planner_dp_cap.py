"""The search keeps only plans whose formula latency is below DP's simulated step
(``dapple_planner._run_searches``): formula 2 leaves out the bubbles inside the pivot stage
(DAPPLE 4.1), so such plans would lose the simulated re-ranking to DP anyway. The cap must
not change which plan is chosen, and it must actually prune."""
from __future__ import annotations

import random

import pytest

import lightning_dapple.plan.dapple_planner as planner
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.partial import TopPlans
from lightning_dapple.simulate.plan_and_schedule import make_plan
from test_planner_optimality import random_instance

REAL_SIMULATE_DP, REAL_SEARCH = planner._simulate_dp, planner.search


def test_top_plans_cap_rejects_later_plans_and_keeps_earlier_ones() -> None:
    top = TopPlans(4)
    top.add(12.0, 1, ((0, 2, (0, 1)),))
    top.add(9.0, 2, ((0, 1, (0,)), (1, 2, (1,))))
    assert top.threshold == float("inf")  # fewer than four plans: no bar yet
    top.set_cap(10.0)
    assert top.threshold == 10.0
    top.add(10.0, 4, ((0, 1, (1,)), (1, 2, (0,))))  # at the cap: not wanted
    top.add(9.5, 4, ((0, 1, (0,)), (1, 2, (1,))))
    assert [item[0] for item in top.items] == [9.0, 9.5, 12.0]
    for latency in (8.0, 7.0):
        top.add(latency, 8, ((0, 1, (0,)), (1, 2, (int(latency) % 2,))))
    assert [item[0] for item in top.items] == [7.0, 8.0, 9.0, 9.5]
    assert top.threshold == 9.5  # the fourth best is below the cap now


def _chosen(args: tuple, capped: bool, monkeypatch: pytest.MonkeyPatch, shortlisted: list[int]) -> tuple:
    def counting_search(*a, **k):  # noqa: ANN002, ANN003, ANN202
        found = REAL_SEARCH(*a, **k)
        shortlisted.append(len(found))
        return found

    monkeypatch.setattr(planner, "_simulate_dp", REAL_SIMULATE_DP if capped else (lambda request, dp: None))
    monkeypatch.setattr(planner, "search", counting_search)
    profile, cluster, gbs, m = args
    try:
        plan = make_plan(profile, cluster, gbs, micro_batches=m)
    except DappleConfigError as error:
        return ("error", str(error))
    return plan.micro_batches, plan.stages, plan.policy, plan.predicted.simulated_latency_ms


def test_dp_cap_changes_no_chosen_plan_and_prunes(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    capped_sizes: list[int] = []
    full_sizes: list[int] = []
    dp_chosen = 0
    for _ in range(150):
        args = random_instance(rng)
        with_cap = _chosen(args, True, monkeypatch, capped_sizes)
        without = _chosen(args, False, monkeypatch, full_sizes)
        assert with_cap == without, args
        dp_chosen += with_cap[0] != "error" and len(with_cap[1]) == 1 and with_cap[1][0].replicas > 1
    assert dp_chosen >= 20
    # fewer formula plans reach the re-ranking: the cap pruned
    assert sum(capped_sizes) < sum(full_sizes), (sum(capped_sizes), sum(full_sizes))
