"""Which plans ``DappleStrategy(tune_steps=N)`` measures (strategy/tune_candidates.py), what
it keeps and says (strategy/plan_tuning.py), and the arguments it refuses; no process starts."""
from __future__ import annotations

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.plan_and_schedule import make_plan
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.auto_plan import PlanningInputs, run_finisher, simulated_as_run
from lightning_dapple.strategy.plan_tuning import MIN_TUNE_GAIN, measured_choice, tuning_sentence
from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan
from lightning_dapple.strategy.tune_candidates import candidate_label, tuning_candidates


def chain(n: int, forward: float = 2.0, params: float = 1e5) -> ModelProfile:
    layers = tuple(LayerProfile(f"layer{i}", forward, 2 * forward, 1e4, params, 1e4) for i in range(n))
    return ModelProfile(1, layers, name=f"chain{n}")


def planned(profile: ModelProfile, cluster: Cluster, rows: int, arguments: PlanArguments) -> Plan:
    """The plan ``plan="auto"`` would run, as the strategy makes it."""
    plan = make_plan(profile, cluster, rows, num_devices=cluster.num_devices, finish=run_finisher(arguments, profile, cluster), **arguments.planner_kwargs())
    return simulated_as_run(resolve_plan(plan, arguments), PlanningInputs(profile, cluster))



def test_candidates_start_with_the_simulators_choice_and_vary_what_is_left_open() -> None:
    profile, cluster, arguments = chain(8), Cluster(1, 4), PlanArguments()
    chosen = planned(profile, cluster, 16, arguments)
    candidates = tuning_candidates(chosen, profile, cluster, arguments, count=6)
    assert candidates[0].plan is chosen and candidates[0].label == candidate_label(chosen)
    assert candidates[0].simulated_ms == pytest.approx(chosen.predicted.simulated_latency_ms)
    assert 2 <= len(candidates) <= 6
    rivals = [each.simulated_ms for each in candidates[1:]]
    assert rivals == sorted(rivals)  # the best rivals by simulated step
    assert len({each.label for each in candidates}) == len(candidates)  # no plan twice
    three = tuning_candidates(chosen, profile, cluster, arguments, count=3)
    shapes = {(each.plan.kind(), each.plan.schedule, each.plan.ooo) for each in candidates}
    assert len(shapes) >= 3  # the pool has other shapes and schedules than the choice's ...
    assert len({(each.plan.kind(), each.plan.schedule, each.plan.ooo) for each in three}) == 3  # ... and three trials take three of them
    for each in candidates:
        each.plan.validate(num_layers=8, world_size=4)
        assert each.plan.global_batch_size == 16


def test_candidates_keep_what_the_user_fixed() -> None:
    profile, cluster = chain(8), Cluster(1, 4)
    arguments = PlanArguments(micro_batches=4, schedule="gpipe", ooo=False)
    chosen = planned(profile, cluster, 16, arguments)
    candidates = tuning_candidates(chosen, profile, cluster, arguments, count=8)
    assert {each.plan.schedule for each in candidates} == {"gpipe"}
    assert {each.plan.micro_batches for each in candidates} == {4}
    assert not any(each.plan.ooo for each in candidates)
    assert len(tuning_candidates(chosen, profile, cluster, arguments, count=1)) == 1


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_named_chunked_schedule_is_kept_by_every_candidate(schedule: str) -> None:
    """The planner's other shapes come as one stage per device group; under a named chunked
    schedule each is cut into chunks, and data parallelism, which has nothing to chunk, is
    not offered."""
    profile, cluster = chain(8, params=1e3), Cluster(1, 4)
    arguments = PlanArguments(schedule=schedule)
    chosen = planned(profile, cluster, 16, arguments)
    candidates = tuning_candidates(chosen, profile, cluster, arguments, count=8)
    assert len(candidates) >= 2
    for each in candidates:
        assert each.plan.schedule == schedule and each.plan.chunks >= 2 and len(each.plan.device_groups) >= 2
        each.plan.validate(num_layers=8, world_size=4)


def test_kept_is_the_fastest_measured_and_the_sentence_says_when_the_simulator_disagrees() -> None:
    profile, cluster, arguments = chain(8), Cluster(1, 4), PlanArguments()
    candidates = tuning_candidates(planned(profile, cluster, 16, arguments), profile, cluster, arguments, count=3)
    assert len(candidates) >= 2
    slower_first = [10.0, 5.0, *[20.0] * (len(candidates) - 2)]
    record = measured_choice(candidates, slower_first) | {"steps": 2}
    assert record["chosen"] == candidates[1].label and record["simulator_choice"] == candidates[0].label
    assert [row["measured_ms"] for row in record["candidates"]] == slower_first
    assert "the simulator ranks them the other way" in tuning_sentence(record)
    agree = measured_choice(candidates, [5.0, 5.0, *[20.0] * (len(candidates) - 2)]) | {"steps": 2}
    assert agree["chosen"] == candidates[0].label  # a tie keeps the simulator's choice
    assert "was also the fastest measured" in tuning_sentence(agree)
    close = [10.0, 10.0 * (1 - MIN_TUNE_GAIN / 2), *[20.0] * (len(candidates) - 2)]
    assert measured_choice(candidates, close)["chosen_index"] == 0  # within the margin: not a measured win
    assert measured_choice(candidates, [10.0, 8.0, *[20.0] * (len(candidates) - 2)], noise=0.25)["chosen_index"] == 0  # within the trials' noise
    assert measured_choice(candidates, [10.0, 8.0, *[20.0] * (len(candidates) - 2)], noise=0.1)["chosen_index"] == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"tune_steps": -1}, "tune_steps"), ({"tune_steps": 2, "tune_candidates": 0}, "tune_candidates"), ({"tune_steps": 2, "plan": {"global_batch_size": 4}}, "tune_steps")],
)
def test_bad_tuning_arguments_are_refused_when_the_strategy_is_made(kwargs: dict, field: str) -> None:
    with pytest.raises(DappleConfigError) as error:
        DappleStrategy(**kwargs)
    assert error.value.field == field
