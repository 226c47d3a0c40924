"""``schedule="auto"`` (plan/schedule_choice.py): the planner's devices and M under the
fastest simulated schedule that fits, the reason that says so, and the entry points that
ask for it (make_plan, the strategy's arguments, dapple-plan)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict
from lightning_dapple.plan.schedule_choice import RUNNABLE_SCHEDULES, choose_schedule
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan
from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan

ROOT = Path(__file__).resolve().parents[1]


def chain(n: int, forward: float = 2.0, params: float = 2e8, stash: float = 1e5, output: float = 1e5) -> ModelProfile:
    layers = tuple(LayerProfile(f"layer{i}", forward, 2 * forward, output, params, stash) for i in range(n))
    return ModelProfile(1, layers, name=f"chain{n}")


# --------------------------------------------------------------------------- stand-in prices


@dataclass(frozen=True)
class _Step:
    latency_ms: float
    bubble_fraction: float = 0.1


def _stand_in(times: dict[str, float], memory: dict[str, float] | None = None, seen: list[str] | None = None, groups: int = 4) -> Any:
    """A pricer with a fixed step time (and per-stage memory) per schedule label; plans on
    other than ``groups`` device groups are labelled 'straight'."""

    def price(plan: Plan, profile: ModelProfile, cluster: Cluster) -> tuple[_Step, list[float], Any]:
        plan.validate(num_layers=profile.num_layers, world_size=plan.world_size)
        label = f"interleaved x{plan.chunks}" if plan.schedule == "interleaved" else plan.schedule
        label += " straight" if len(plan.device_groups) != groups else ""
        if seen is not None:
            seen.append(label)
        if label not in times:
            raise DappleConfigError("plan.schedule", f"{label} is not priced here", "price it")
        per_stage = (memory or {}).get(label, 1.0)
        return _Step(times[label]), [per_stage] * plan.num_stages, stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)

    return price


def _straight(layers: int, groups: int, micro_batches: int) -> Plan:
    bounds = [layers * g // groups for g in range(groups + 1)]
    stages = tuple(StagePlan(layers=(bounds[g], bounds[g + 1]), devices=(g,)) for g in range(groups))
    return Plan(micro_batches, micro_batches, stages, reason="straight pipeline").with_warmups()


def test_chunks_grow_while_faster_and_the_why_names_every_candidate() -> None:
    times = {"dapple": 100.0, "gpipe": 110.0, "interleaved x2": 80.0, "interleaved x3": 70.0, "interleaved x4": 75.0, "zbv": 72.0}
    seen: list[str] = []
    plan = choose_schedule(_straight(32, 4, 4), chain(32), Cluster(4, 1), _stand_in(times, seen=seen))
    assert seen == ["dapple", "gpipe", "interleaved x2", "interleaved x3", "interleaved x4", "zbv"]  # x4 was slower: no x5
    assert plan.schedule == "interleaved" and plan.chunks == 3 and plan.placement == tuple(k % 4 for k in range(12))
    assert plan.predicted is not None and plan.predicted.simulated_latency_ms == 70.0
    choice = plan.extra["schedule_choice"]
    assert choice["chosen"] == "interleaved x3"
    assert [c["simulated_ms"] for c in choice["candidates"]] == [100.0, 110.0, 80.0, 70.0, 75.0, 72.0]
    assert plan.reason.startswith("straight pipeline. Schedule interleaved x3 (1:1:1:1 x3 chunks): 70.00 ms simulated, beat dapple 100.00 ms (+43%)")
    assert "zbv 72.00 ms (+3%)" in plan.reason


def test_a_tie_is_named_a_tie_and_the_first_listed_is_kept() -> None:
    """Processes sharing cores bind every schedule at the same compute (simulate.cores):
    dapple and gpipe then simulate equal steps, and the why says so instead of 'beat +0%'."""
    times = {"dapple": 42.5, "gpipe": 42.5 * (1 + 1e-4), "interleaved x2": 50.0, "zbv": 60.0}
    plan = choose_schedule(_straight(32, 4, 4), chain(32), Cluster(4, 1), _stand_in(times))
    assert plan.schedule == "dapple"
    assert "beat interleaved x2 50.00 ms (+18%), zbv 60.00 ms (+41%), tied with gpipe 42.50 ms (dapple is listed first)" in plan.reason
    assert "+0%" not in plan.reason


def test_a_candidate_over_the_memory_budget_loses_and_is_named() -> None:
    cluster = Cluster(4, 1, device_memory_gib=1.0)
    times = {"dapple": 100.0, "gpipe": 90.0, "interleaved x2": 80.0, "interleaved x3": 85.0, "zbv": 60.0}
    memory = {"zbv": 1.2 * 2**30}  # per stage: the bytes of the device group running it
    plan = choose_schedule(_straight(16, 4, 4), chain(16), cluster, _stand_in(times, memory))
    assert plan.schedule == "interleaved" and plan.chunks == 2
    assert "did not fit: zbv (60.00 ms, needs 1.20 GiB per device, more than 1.00 GiB)" in plan.reason
    assert plan.extra["schedule_choice"]["candidates"][-1]["fits"] is False


def test_hybrid_plans_also_try_the_straight_shape() -> None:
    stages = (StagePlan((0, 8), (0, 1)), StagePlan((8, 16), (2, 3)))
    hybrid = Plan(8, 4, stages, reason="2:2 pipeline").with_warmups()
    times = {"dapple": 100.0, "gpipe": 100.0, "interleaved x2": 95.0, "interleaved x3": 96.0, "zbv": 97.0, "interleaved x2 straight": 90.0}
    times |= {"interleaved x3 straight": 91.0, "zbv straight": 85.0}
    plan = choose_schedule(hybrid, chain(16), Cluster(4, 1), _stand_in(times, groups=2))
    assert plan.schedule == "zbv" and plan.device_groups == ((0,), (1,), (2,), (3,))
    assert plan.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert "Schedule zbv on the straight shape (1:1:1:1 x2 chunks): 85.00 ms simulated" in plan.reason


def test_one_device_group_runs_dapple_only() -> None:
    plan = make_plan(chain(8, params=1e3), Cluster(1, 4), 8, schedule="auto")
    assert plan.kind() == "DP" and plan.schedule == "dapple"
    assert [c["label"] for c in plan.extra["schedule_choice"]["candidates"]] == ["dapple"]
    assert plan.reason.endswith("Schedule dapple: %.2f ms simulated." % plan.predicted.simulated_latency_ms)


def test_a_named_chunked_schedule_that_cannot_run_is_an_error() -> None:
    with pytest.raises(DappleConfigError, match="none of \\['zbv'\\] can run this plan"):
        choose_schedule(_straight(16, 4, 4), chain(16), Cluster(4, 1), _stand_in({"dapple": 1.0}), schedules=("zbv",))


# --------------------------------------------------------------------------- real prices


def test_memory_tight_keeps_the_schedule_that_fits() -> None:
    """GPipe simulates faster here (all forwards first, M=8) but stashes all 8 micro-batches."""
    profile = chain(8, params=1e6, stash=5e8)
    cluster = Cluster(4, 1, inter_bandwidth_gbps=1.0, device_memory_gib=4.0)
    plan = make_plan(profile, cluster, 8, micro_batches=8, schedule="auto", schedules=("dapple", "gpipe"))
    assert plan.schedule == "dapple" and plan.kind() == "straight"
    gpipe = next(c for c in plan.extra["schedule_choice"]["candidates"] if c["schedule"] == "gpipe")
    assert gpipe["fits"] is False and gpipe["simulated_ms"] < plan.predicted.simulated_latency_ms
    assert "did not fit: gpipe" in plan.reason and "more than 4.00 GiB" in plan.reason
    roomy = make_plan(profile, Cluster(4, 1, inter_bandwidth_gbps=1.0, device_memory_gib=16.0), 8, micro_batches=8, policy="PA", schedule="auto", schedules=("dapple", "gpipe"))
    assert roomy.schedule == "gpipe" and "beat dapple" in roomy.reason


def test_named_dapple_keeps_the_planners_plan() -> None:
    profile, cluster = chain(16), Cluster(4, 1, inter_bandwidth_gbps=1.0)
    named = make_plan(profile, cluster, 8, schedule="dapple")
    assert named == make_plan(profile, cluster, 8) and "schedule_choice" not in named.extra
    auto = make_plan(profile, cluster, 8, schedule="auto", schedules=("dapple",))
    assert auto.stages == named.stages and auto.micro_batches == named.micro_batches and auto.schedule == "dapple"


def test_chosen_plan_validates_and_simulates_as_recorded() -> None:
    profile, cluster = chain(16), Cluster(4, 1, inter_bandwidth_gbps=1.0)
    plan = make_plan(profile, cluster, 8, schedule="auto")
    again = plan_from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert simulate_plan(again, profile, cluster).latency_ms == pytest.approx(plan.predicted.simulated_latency_ms)
    fastest = min(c["simulated_ms"] for c in plan.extra["schedule_choice"]["candidates"] if c["fits"])
    assert plan.predicted.simulated_latency_ms == fastest


def test_strategy_arguments_default_to_auto_and_keep_given_plans() -> None:
    arguments = PlanArguments()
    assert arguments.planner_kwargs()["schedule"] == "auto"
    assert PlanArguments(schedule="gpipe").planner_kwargs()["schedule"] == "gpipe"
    given = _straight(16, 4, 4)
    assert resolve_plan(given, PlanArguments(schedule="auto")).schedule == "dapple"
    assert resolve_plan(given, PlanArguments(schedule="gpipe")).schedule == "gpipe"
    with pytest.raises(DappleConfigError, match="'auto' or one of"):
        PlanArguments(schedule="pipedream")
    assert RUNNABLE_SCHEDULES[:2] == ("dapple", "gpipe")


def test_dapple_plan_prints_the_why(tmp_path: Path) -> None:
    """``dapple-plan ... --schedule auto | cat``: the plan's why names the schedule and what it beat."""
    profile = tmp_path / "chain.json"
    profile.write_text(chain(16).to_json())
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(Cluster(4, 1, inter_bandwidth_gbps=1.0).to_dict()))
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lightning_dapple.cli.plan", "--profile", str(profile), "--cluster", str(cluster), "--global-batch-size", "8"]

    def run(*extra: str) -> str:
        return subprocess.run([*command, *extra], capture_output=True, text=True, env=env, timeout=300, check=True).stdout

    shown = " ".join(run("--schedule", "auto").split())  # rich wraps at 80 columns when piped
    choice = json.loads(run("--schedule", "auto", "--json"))["extra"]["schedule_choice"]
    assert "why: straight pipeline" in shown, shown
    assert f"Schedule {choice['chosen']} (" in shown and " ms simulated, beat dapple " in shown
    for candidate in choice["candidates"]:
        assert f"{candidate['label']} " in shown and f"{candidate['simulated_ms']:.2f} ms" in shown, candidate
    assert "Schedule " not in run("--schedule", "dapple")


def _split_chain(n: int) -> ModelProfile:
    """F = B_input = B_weight per layer: the case ZB-V is built for."""
    layers = tuple(LayerProfile(f"layer{i}", 2.0, 4.0, 1e5, 2e8, 1e5, backward_input_ms=2.0, backward_weight_ms=2.0) for i in range(n))
    return ModelProfile(1, layers, name=f"split{n}")


def _simulated(plan: Plan) -> dict[str, float]:
    return {c["label"]: c["simulated_ms"] for c in plan.extra["schedule_choice"]["candidates"] if "simulated_ms" in c}


SLOW_LINKS = Cluster(4, 1, inter_bandwidth_gbps=1.0, device_memory_gib=64.0)  # DP's AllReduce of 3.2 GB is hopeless: straight pipelines


def test_few_micro_batches_on_a_deep_pipeline_interleave() -> None:
    plan = make_plan(chain(32), SLOW_LINKS, 4, micro_batches=4, schedule="auto", schedules=("dapple", "gpipe", "interleaved"))
    times = _simulated(plan)
    assert plan.schedule == "interleaved" and plan.kind() == f"1:1:1:1 x{plan.chunks} chunks" and plan.chunks >= 2
    assert times[f"interleaved x{plan.chunks}"] == min(times.values()) < times["dapple"]
    # the chunk count grew while it got faster and stopped at the first slower one
    counts = [int(label.split("x")[1]) for label in times if label.startswith("interleaved")]
    assert counts == list(range(2, plan.chunks + 2)) and times[f"interleaved x{plan.chunks + 1}"] >= times[f"interleaved x{plan.chunks}"]
    assert f"beat dapple {times['dapple']:.2f} ms" in plan.reason
    # every chunk has layers and the groups share the work evenly (32 equal layers: 8 per device)
    per_group = [sum(s.end - s.start for s, g in zip(plan.stages, plan.placement) if g == group) for group in range(4)]
    assert per_group == [8, 8, 8, 8]


def test_zero_bubble_v_wins_when_weight_gradients_split_evenly() -> None:
    plan = make_plan(_split_chain(16), SLOW_LINKS, 8, micro_batches=8, schedule="auto")
    times = _simulated(plan)
    assert plan.schedule == "zbv" and plan.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert times["zbv"] < min(time for label, time in times.items() if label != "zbv")
    assert plan.reason.split(". Schedule ")[1].startswith(f"zbv (1:1:1:1 x2 chunks): {times['zbv']:.2f} ms simulated, beat dapple")


def test_costly_transfers_keep_dapple() -> None:
    """Chunks send every micro-batch across the devices v times as often: with 8 ms per
    boundary transfer that costs more than the bubble they save."""
    plan = make_plan(chain(8, output=1e6), SLOW_LINKS, 16, micro_batches=16, schedule="auto")
    times = _simulated(plan)
    assert plan.schedule == "dapple" and plan.kind() == "straight"
    assert times["interleaved x2"] > times["dapple"] and times["zbv"] > times["dapple"]


def test_the_runs_ooo_choice_is_made_for_every_candidate() -> None:
    """The strategy's finisher runs on each candidate: dapple with its ooo choice, a chunked
    winner with ooo off and the reason why."""
    from lightning_dapple.strategy.auto_plan import run_finisher

    profile = _split_chain(16)
    finish = run_finisher(PlanArguments(), profile, SLOW_LINKS)
    plan = make_plan(profile, SLOW_LINKS, 8, micro_batches=8, schedule="auto", finish=finish)
    assert plan.schedule == "zbv" and not plan.ooo
    assert plan.extra["ooo_choice"] == "off (auto: the 'zbv' schedule of several stages per device group places its own backward work)"
    dapple = make_plan(profile, SLOW_LINKS, 8, micro_batches=8, schedule="dapple", finish=finish)
    assert dapple.ooo and dapple.extra["ooo_choice"].startswith("on (auto: simulated step")
    assert _simulated(plan)["dapple"] == pytest.approx(simulate_plan(dapple, profile, SLOW_LINKS).latency_ms)  # priced with ooo on


@pytest.mark.timeout(600)
def test_table4_plans_are_what_auto_starts_from() -> None:
    """A Table 4 cell (BERT-48 on config B, DAPPLE 6.2): a named 'dapple' gives today's plan,
    and 'auto' prices exactly that plan as its dapple candidate before the others."""
    from lightning_dapple.app.recipe_profile import recipe_global_batch, recipe_profile, shared_profiles_dir
    from lightning_dapple.cluster import load_cluster

    if shared_profiles_dir() is None:
        pytest.skip("needs ../shared/profiles")
    profile, cluster, batch = recipe_profile("bert", prefer_shared=True), load_cluster("paper-b"), recipe_global_batch("bert")
    today = make_plan(profile, cluster, batch)
    assert make_plan(profile, cluster, batch, schedule="dapple") == today
    auto = make_plan(profile, cluster, batch, schedule="auto")
    first = auto.extra["schedule_choice"]["candidates"][0]
    assert first["label"] == "dapple" and first["simulated_ms"] == pytest.approx(today.predicted.simulated_latency_ms)
    assert auto.micro_batches == today.micro_batches and auto.device_groups == today.device_groups


def test_a_named_chunked_schedule_is_cut_and_priced_alone() -> None:
    plan = make_plan(chain(16), SLOW_LINKS, 8, micro_batches=8, schedule="interleaved")
    assert plan.schedule == "interleaved" and plan.chunks >= 2
    assert {c["schedule"] for c in plan.extra["schedule_choice"]["candidates"]} == {"interleaved"}
    with pytest.raises(DappleConfigError) as error:
        make_plan(chain(16), SLOW_LINKS, 6, micro_batches=6, schedule="interleaved")
    assert "none of ['interleaved'] can run this plan" in str(error.value) and "rounds of the 4 device groups" in str(error.value)


def test_a_named_chunked_schedule_gets_the_fastest_pipeline_where_dp_would_win() -> None:
    """Where data parallelism simulates fastest, naming a chunked schedule must not fail on
    a plan with nothing to chunk: the planner keeps its fastest pipeline and says what DP
    would have taken."""
    profile, cluster = chain(8, params=1e3), Cluster(1, 2)
    assert make_plan(profile, cluster, 8).kind() == "DP"
    plan = make_plan(profile, cluster, 8, schedule="interleaved")
    assert plan.schedule == "interleaved" and len(plan.device_groups) == 2 and plan.chunks >= 2
    assert "under DP" in plan.reason
    with pytest.raises(DappleConfigError, match="no plan of 8 layers on 1 device.* has two device groups"):
        make_plan(profile, Cluster(1, 1), 8, schedule="zbv")
    # fewer layers than devices: no straight pipeline, and the search's plans faster than DP
    # are all DP at other M; the pipelines slower than DP must still be searched
    few_layers = chain(6, params=1e5)
    assert make_plan(few_layers, Cluster(1, 8), 64).kind() == "DP"
    assert len(make_plan(few_layers, Cluster(1, 8), 64, schedule="interleaved").device_groups) >= 2


def test_dapple_plan_defaults(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """dapple-plan chooses the schedule for DAPPLE's planner; the PipeDream baseline keeps
    DAPPLE's schedule unless asked."""
    from lightning_dapple.cli.plan import main

    profile = tmp_path / "chain.json"
    profile.write_text(chain(16).to_json())
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(SLOW_LINKS.to_dict()))
    base = ["--profile", str(profile), "--cluster", str(cluster), "--global-batch-size", "8", "--json"]
    assert main(base) == 0
    assert "schedule_choice" in json.loads(capsys.readouterr().out)["extra"]
    assert main([*base, "--planner", "pipedream"]) == 0
    baseline = json.loads(capsys.readouterr().out)
    assert baseline["schedule"] == "dapple" and "schedule_choice" not in baseline.get("extra", {})


def test_the_hydra_strategy_group_asks_for_auto() -> None:
    from lightning_dapple.app.config import compose_recipe
    from lightning_dapple.app.train import _plan_arguments

    cfg = compose_recipe("vgg_tiny")
    assert _plan_arguments(cfg, int(cfg.data.batch_size)).planner_kwargs()["schedule"] == "auto"
    named = compose_recipe("vgg_tiny", ["strategy.schedule=zbv"])
    assert _plan_arguments(named, int(named.data.batch_size)).schedule == "zbv"


def test_auto_leaves_chunked_schedules_out_where_cpu_processes_share_cores() -> None:
    from lightning_dapple.plan.plan import CHUNKED_SCHEDULES
    from lightning_dapple.strategy.auto_plan import schedules_for_cores

    shared, why = schedules_for_cores("cpu", local_processes=4, cores=2)
    assert not set(shared) & set(CHUNKED_SCHEDULES) and "dapple" in shared
    assert "4 CPU processes share 2 cores" in why
    for device_type, processes, cores in (("cpu", 4, 4), ("cuda", 4, 2), ("cpu", 1, 1)):
        kept, reason = schedules_for_cores(device_type, processes, cores)
        assert set(CHUNKED_SCHEDULES) <= set(kept) and reason == ""
