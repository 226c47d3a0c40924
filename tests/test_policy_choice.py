"""K_i policy chosen by simulation (``plan/policy_choice.py``, DAPPLE 5.3): P_B's deeper
warm-up where it is faster and fits, capped by each stage's memory, never a stall."""
from __future__ import annotations

import pytest
from conftest import shared_profiles

from lightning_dapple.cluster import load_cluster
from lightning_dapple.plan.evaluate import in_flight_limits, score_stages
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict
from lightning_dapple.plan.policy_choice import simulate_policies
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.profile import load_profile
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.plan_and_schedule import make_plan

PROFILES = shared_profiles()


def test_memory_caps_keep_the_warmups_falling_by_one() -> None:
    # uncapped: the policies' own counts, M-capped runs of equal counts allowed
    assert warmup_counts(3, 16, "PB") == [5, 3, 1]
    assert warmup_counts(8, 4, "PA") == [4, 4, 4, 4, 4, 3, 2, 1]
    # a cap on an early stage caps the later ones, one fewer each (no round-trip stall)
    assert warmup_counts(3, 16, "PB", memory_limits=[3, 5, 5]) == [3, 2, 1]
    assert warmup_counts(4, 16, "PB", memory_limits=[9, 9, 2, 9]) == [7, 5, 2, 1]
    # a stage holding all M micro-batches lets the next one hold them all too
    assert warmup_counts(3, 3, "PB", memory_limits=[9, 9, 9]) == [3, 3, 1]


def test_equal_neighbouring_warmups_stall_on_round_trips() -> None:
    # why the rule above: K = [3, 3, 1] makes stage 1 wait a round trip through stage 0
    # for every forward after its warm-up; [3, 2, 1] does not
    profile = load_profile(PROFILES / "dapple" / "xlnet-36-pbs-1.txt")
    cluster = load_cluster("paper-b")
    stages = [((0, 15), range(0, 4)), ((15, 24), range(4, 8)), ((24, 43), range(8, 16))]
    def simulated(warmups: list[int]) -> float:
        plan = Plan(128, 16, tuple(StagePlan(layers, tuple(devices), warmup=k) for (layers, devices), k in zip(stages, warmups)), policy="PB")
        return simulate_plan(plan, profile, cluster).latency_ms
    assert simulated([3, 3, 1]) > 1.3 * simulated([3, 2, 1])


def test_auto_picks_pb_where_it_simulates_faster() -> None:
    profile = load_profile(PROFILES / "dapple" / "bert-48-pbs-2.txt")
    cluster = load_cluster("paper-a")
    fixed = make_plan(profile, cluster, 64, policy="PA")
    auto = make_plan(profile, cluster, 64)
    assert fixed.policy == "PA"
    assert auto.policy == "PB"
    choice = auto.extra["policy_choice"]
    assert choice["policy"] == "PB" and choice["simulated_ms"]["PB"] < choice["simulated_ms"]["PA"]
    assert auto.predicted.simulated_latency_ms == pytest.approx(choice["simulated_ms"]["PB"])
    assert auto.predicted.simulated_latency_ms < fixed.predicted.simulated_latency_ms
    assert "K_i policy PB (DAPPLE 5.3)" in auto.reason
    # the plan carries the K_i it was simulated with, sized by the memory model
    assert [stage.warmup for stage in auto.stages] == choice["warmups"]
    assert max(auto.predicted.memory_bytes) <= cluster.device_memory_bytes
    again = plan_from_dict(auto.to_dict())
    assert [stage.warmup for stage in again.stages] == choice["warmups"]
    assert simulate_plan(again, profile, cluster).latency_ms == pytest.approx(auto.predicted.simulated_latency_ms)


def test_pb_capped_by_memory_to_pa_is_not_tried() -> None:
    # XLNet-36 stashes 5.9 GB per sample: on this 4:4:8 plan stage 0 holds only 3
    # micro-batches, so P_B's counts fall back to P_A's and only P_A is simulated
    profile = load_profile(PROFILES / "dapple" / "xlnet-36-pbs-1.txt")
    cluster = load_cluster("paper-b")
    stages = (StagePlan((0, 15), tuple(range(4))), StagePlan((15, 24), tuple(range(4, 8))), StagePlan((24, 43), tuple(range(8, 16))))
    request = PlanRequest.build(profile, cluster, 128, policy="auto", simulate=simulate_plan)
    item = score_stages(profile, cluster, stages, 128, 16)
    assert in_flight_limits(item.costs, 16, cluster)[0] == 3
    choice = simulate_policies(request, item)
    assert list(choice.tried) == ["PA"] and choice.policy == "PA" and choice.warmups == (3, 2, 1)
    assert choice.note() == ""


def test_fixed_policy_and_single_stage_plans_simulate_once() -> None:
    profile = load_profile(PROFILES / "dapple" / "bert-48-pbs-2.txt")
    cluster = load_cluster("paper-a")
    two = (StagePlan((0, 28), tuple(range(8))), StagePlan((28, 53), tuple(range(8, 16))))
    item = score_stages(profile, cluster, two, 64, 4)
    fixed = simulate_policies(PlanRequest.build(profile, cluster, 64, policy="PB", simulate=simulate_plan), item)
    assert list(fixed.tried) == ["PB"] and fixed.warmups == (3, 1)
    request = PlanRequest.build(profile, cluster, 64, policy="auto", simulate=simulate_plan)
    dp = score_stages(profile, cluster, (StagePlan((0, 53), tuple(range(16))),), 64, 4)
    assert list(simulate_policies(request, dp).tried) == ["PA"]
    # a plan that cannot step faster than one already simulated is priced under P_A only
    assert list(simulate_policies(request, item).tried) == ["PA", "PB"]
    assert list(simulate_policies(request, item, beat=100.0).tried) == ["PA"]


@pytest.mark.parametrize("name,cluster_name", [("bert-48-pbs-2.txt", "paper-a"), ("xlnet-36-pbs-1.txt", "paper-c"), ("gnmt-16-pbs-64.txt", "paper-b")])
def test_no_schedule_steps_faster_than_the_lower_bound(name: str, cluster_name: str) -> None:
    # what lets the policy choice skip P_B for a plan that cannot win (costs.step_lower_bound)
    from lightning_dapple.plan.costs import stage_costs, step_lower_bound
    from lightning_dapple.plan.options import with_weight_split

    profile = load_profile(PROFILES / "dapple" / name)
    cluster = load_cluster(cluster_name)
    n = profile.num_layers
    layouts = {
        "8:8": [((0, n // 2), range(8)), ((n // 2, n), range(8, 16))],
        "4x4": [((k * n // 4, (k + 1) * n // 4), range(4 * k, 4 * k + 4)) for k in range(4)],
        "straight": [((k * n // 16, (k + 1) * n // 16), [k]) for k in range(16)],
    }
    gbs = 128 if "pbs-1" in name else (64 if "pbs-2" in name else 1024)
    checked = 0
    for layout in layouts.values():
        stages = tuple(StagePlan(layers, tuple(devices)) for layers, devices in layout)
        for m in (4, 8):
            for schedule, policy, ooo in (("dapple", "PA", False), ("dapple", "PB", False), ("gpipe", "PA", False), ("dapple", "PA", True)):
                # with ooo the simulator prices the profile with its backward split into B and W
                costs = stage_costs(with_weight_split(profile) if ooo else profile, cluster, stages, gbs // m)
                bound = step_lower_bound(costs, m)
                plan = Plan(gbs, m, stages, schedule=schedule, policy=policy, ooo=ooo)
                simulated = simulate_plan(plan, profile, cluster).latency_ms
                assert simulated >= bound * (1 - 1e-9), (name, layout, m, schedule, policy, ooo, simulated, bound)
                checked += 1
    assert checked == 24


def test_strategy_keeps_the_planners_warmups_for_the_arguments_it_planned_with() -> None:
    # plan="auto" hands M to the planner, whose P_B counts may be capped by memory; the
    # strategy's own override step must not refill them uncapped
    from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan

    stages = (StagePlan((0, 2), (0,), warmup=3), StagePlan((2, 4), (1,), warmup=2), StagePlan((4, 6), (2,), warmup=1))
    plan = Plan(64, 8, stages, policy="PB")
    same = resolve_plan(plan, PlanArguments(micro_batches=8, policy="PB", ooo=False))
    assert [stage.warmup for stage in same.stages] == [3, 2, 1]
    other = resolve_plan(plan, PlanArguments(micro_batches=16, ooo=False))
    assert [stage.warmup for stage in other.with_warmups().stages] == [5, 3, 1]


def test_the_plan_as_run_carries_its_own_simulated_step() -> None:
    """A recomputation mode given by the user changes the step the planner simulated: the
    plan the run saves and prints simulates the plan that runs, as its report does."""
    from lightning_dapple.strategy.auto_plan import PlanningInputs, simulated_as_run
    from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan

    profile = load_profile(PROFILES / "dapple" / "bert-48-pbs-2.txt")
    cluster = load_cluster("paper-a")
    planned = make_plan(profile, cluster, 64)
    run = resolve_plan(planned, PlanArguments(recompute="always"))
    as_run = simulated_as_run(run, PlanningInputs(profile, cluster))
    expected = simulate_plan(run, profile, cluster)
    assert as_run.predicted.simulated_latency_ms == pytest.approx(expected.latency_ms)
    assert as_run.predicted.simulated_latency_ms > planned.predicted.simulated_latency_ms  # the recomputed forwards
