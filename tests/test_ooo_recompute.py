"""Out-of-order backprop and recomputation: schedules, cost model, planner, executor.

Papers: ooo-backprop.txt sec. 3 (B/W split), 5.2 (gradient fast-forwarding), 5.1 and
Algorithm 2 (reverse first-k); gpipe.txt 2.3 (re-materialization); dapple-ppopp21.txt 6.5.
The executor cases run in one spawned group of 4 gloo ranks (float64, Adam, clipping,
3 steps): every schedule x ooo x recompute on the equivalence plans matches single-device
training to 1e-10; with dropout every variant matches the same plan without ooo and
recomputation; measured peak stashed bytes stay within the planner's estimate; a plan
whose memory budget is below what ``never`` needs runs within that budget.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import shared_profiles

from dist_harness import run_ranks
from lightning_dapple.cli.simulate import main as simulate_main
from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import StageCost, dapple_latency, stage_costs
from lightning_dapple.plan.plan import Plan, StagePlan, plan_from_dict, straight_plan
from lightning_dapple.simulate.memory_fit import apply_ooo_recompute
from lightning_dapple.simulate.plan_and_schedule import stage_memory
from lightning_dapple.plan.options import with_weight_split
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.schedule import Kind, build_schedule, compute_order
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan
from lightning_dapple.schedule.actions import stash_walk
from lightning_dapple.schedule.ooo import build_ooo_schedule, ending_order
from lightning_dapple.simulate import simulate, simulate_plan
from test_executor_equivalence import PLANS

PROFILES = shared_profiles() / "dapple"


def unit_cost(f: float = 1.0, b: float = 1.0, w: float = 1.0, **extra: float) -> StageCost:
    return StageCost(
        forward_ms=f, backward_ms=b + w, backward_input_ms=b, backward_weight_ms=w, param_bytes=0.0,
        stash_bytes=1.0, output_bytes=0.0, send_ms=0.0, allreduce_ms=0.0, slice_size=1.0, **extra,
    )


def uniform_profile(num_layers: int, param_bytes: float = 1e6, stash: float = 1e8, output: float = 1e6) -> ModelProfile:
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 2.0, output, param_bytes, stash, backward_input_ms=1.0, backward_weight_ms=1.0)
        for i in range(num_layers)
    )
    return ModelProfile(micro_batch_size=4, layers=layers, name="uniform", input_bytes=output)


# --------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("name", ["dapple", "gpipe"])
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 3), (2, 4), (3, 4), (4, 8), (5, 3)])
def test_ooo_lists_keep_base_order_and_place_each_w_after_its_i(name: str, stages: int, micro_batches: int) -> None:
    built = build_ooo_schedule(name, stages, micro_batches)
    plain = build_schedule(name, stages, micro_batches)
    for s in range(stages):
        assert built.splits(s) and not plain.splits(s)
        compute = built.compute(s)
        assert not any(a.kind is Kind.B for a in compute)  # every backward is input-only, its W follows
        fb = [(Kind.B if a.kind is Kind.I else a.kind, a.microbatch) for a in compute if a.kind is not Kind.W]
        assert fb == [(a.kind, a.microbatch) for a in plain.compute(s)]
        position = {(a.kind, a.microbatch): i for i, a in enumerate(compute)}
        for mb in range(micro_batches):
            assert position[(Kind.I, mb)] < position[(Kind.W, mb)]
        # the gradient leaves right after I (fast-forwarding), before any W
        actions = built.actions[s]
        for index, action in enumerate(actions):
            if action.kind is Kind.I and s > 0:
                assert actions[index + 1].kind is Kind.SEND_GRAD
        assert actions[-1].kind is Kind.ALLREDUCE
    result = simulate(built, [unit_cost() for _ in range(stages)])
    for s, st in enumerate(result.stages):
        assert st.peak_in_flight <= built.in_flight_caps[s]


def test_example_action_lists_s3_m4() -> None:
    built = build_ooo_schedule("dapple", 3, 4)
    assert [built.describe(s) for s in range(3)] == [
        "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


def test_uniform_bubble_with_ooo_is_at_most_half() -> None:
    """F:B:W = 1:1:1, S = 4, M = 8: (S-1)(F+B+W) of idle time per device becomes (S-1)(F+B-W)."""
    costs = [unit_cost() for _ in range(4)]
    plain = simulate(build_schedule("dapple", 4, 8), costs)
    ooo = simulate(build_ooo_schedule("dapple", 4, 8), costs)
    assert plain.bubble_fraction == pytest.approx(3 / 11)
    assert ooo.latency_ms == pytest.approx(8 * 3 + 3)
    assert ooo.bubble_fraction <= plain.bubble_fraction / 2
    gpipe_plain = simulate(build_schedule("gpipe", 4, 8), costs)
    gpipe_ooo = simulate(build_ooo_schedule("gpipe", 4, 8), costs)
    assert gpipe_ooo.latency_ms < gpipe_plain.latency_ms
    # the same through the plan path the executor uses (schedule_for_plan, stage_costs)
    profile = uniform_profile(8, param_bytes=0.0)
    plan = straight_plan(8, [2, 4, 6], 32, 8)
    with_plan = simulate_plan(replace(plan, ooo=True), profile, Cluster(1, 4))
    without = simulate_plan(plan, profile, Cluster(1, 4))
    assert with_plan.bubble_fraction <= without.bubble_fraction / 2


def test_caps_bound_what_a_stage_holds() -> None:
    warmups = [4, 3, 2, 1]
    tight = build_ooo_schedule("dapple", 4, 8, warmups, caps=warmups)
    loose = build_ooo_schedule("dapple", 4, 8, warmups)
    costs = [unit_cost() for _ in range(4)]
    assert [s.peak_in_flight for s in simulate(tight, costs).stages] == warmups
    assert [s.peak_in_flight for s in simulate(loose, costs).stages] == [4, 4, 4, 4]
    assert simulate(loose, costs).latency_ms <= simulate(tight, costs).latency_ms


def test_except_last_keeps_the_micro_batch_last_in_flight() -> None:
    gpipe = replace(build_schedule("gpipe", 2, 4), recompute=("except_last", "always"))
    assert gpipe.recomputed(0) == {0, 1, 2} and gpipe.recomputed(1) == {0, 1, 2, 3}
    dapple = replace(build_schedule("dapple", 3, 4), recompute=("except_last",) * 3)
    assert dapple.recomputed(0) == {0, 1, 2}  # F3 is followed by B1, B2, B3: only mb 3 kept
    assert dapple.recomputed(2) == frozenset()  # K = 1: every B follows its own F
    assert replace(dapple, recompute=("never",) * 3).recomputed(0) == frozenset()


def test_recomputed_micro_batches_wait_for_w_one_at_a_time() -> None:
    """Deferral plus recomputation must not keep every replayed activation alive."""
    built = build_ooo_schedule("gpipe", 2, 6, recompute=("always", "always"))
    for s in range(2):
        waiting = 0
        for action in built.compute(s):
            if action.kind is Kind.I:
                assert waiting == 0
                waiting += 1
            elif action.kind is Kind.W:
                waiting -= 1


def test_stash_walk_rules() -> None:
    order = compute_order("gpipe", 0, 1, 2, 2)  # F0 F1 B0 B1
    assert stash_walk(order, frozenset(), 10.0) == (20.0, 2)
    assert stash_walk(order, frozenset({0, 1}), 10.0, input_bytes=1.0) == (12.0, 2)  # 1 + (1 + 10)
    ooo = build_ooo_schedule("gpipe", 1, 2).compute(0)  # F0 F1 I0 I1 W0 W1
    assert [a.label for a in ooo] == ["F0", "F1", "I0", "I1", "W0", "W1"]
    assert stash_walk(ooo, frozenset(), 10.0, wgrad_bytes=3.0) == (26.0, 2)


def test_ending_order_is_algorithm_2() -> None:
    assert ending_order(5, 0) == [4, 3, 2, 1, 0]
    assert ending_order(5, 3) == [4, 3, 0, 1, 2]
    assert ending_order(5, 5) == [0, 1, 2, 3, 4]
    built = build_ooo_schedule("dapple", 2, 3, layer_counts=[3, 2], replicated=[True, False], first_k=2)
    tail = [a.label for a in built.actions[0][-4:]]
    assert tail == ["W2[2:3]", "W2[0:1]", "W2[1:2]", "allreduce[0:3]"]  # sizes unknown: one bucket
    assert built.actions[1][-1].label == "allreduce"
    # bucket_layers([10, 10, 10], 10) = [2:3], [1:2], [0:1]: launched in that order, each
    # after the part completing it and after the bucket before it
    sized = build_ooo_schedule(
        "dapple", 2, 3, layer_counts=[3, 2], replicated=[True, False], first_k=2, param_bytes=[[10, 10, 10], [1, 1]], bucket_bytes=10
    )
    tail = [a.label for a in sized.actions[0][-6:]]
    assert tail == ["W2[2:3]", "allreduce[2:3]", "W2[0:1]", "W2[1:2]", "allreduce[1:2]", "allreduce[0:1]"]
    assert [a.label for a in sized.actions[1]] == [a.label for a in built.actions[1]]


# --------------------------------------------------------------------------- cost model, planner


def test_cost_model_adds_recompute_time_and_keeps_never_unchanged() -> None:
    profile = uniform_profile(4)
    plan = straight_plan(4, [2], 16, 4)
    never = stage_costs(profile, Cluster(1, 2), plan.stages, 4)
    again = stage_costs(profile, Cluster(1, 2), replace(plan, stages=(replace(plan.stages[0], recompute="always"), plan.stages[1])).stages, 4)
    assert never[0].recompute_ms == 0.0 and again[0].recompute_ms == again[0].forward_ms == 2.0
    assert again[1] == never[1]
    base = dapple_latency(never, 4)
    more = dapple_latency(again, 4)
    assert more.latency_ms > base.latency_ms
    simulated = simulate_plan(replace(plan, stages=(replace(plan.stages[0], recompute="always"), plan.stages[1])), profile, Cluster(1, 2))
    plain = simulate_plan(plan, profile, Cluster(1, 2))
    assert simulated.latency_ms > plain.latency_ms
    b_spans = [s for s in simulated.stages[0].spans if s.kind == "B"]
    assert all(s.end_ms - s.start_ms == pytest.approx(4.0 + 2.0) for s in b_spans)


def test_weight_split_estimate_only_fills_missing_splits() -> None:
    layers = (
        LayerProfile("a", 1.0, 4.0, 1.0, 8.0, 1.0),
        LayerProfile("b", 1.0, 4.0, 1.0, 0.0, 1.0),
        LayerProfile("c", 1.0, 4.0, 1.0, 8.0, 1.0, backward_input_ms=3.0, backward_weight_ms=1.0),
    )
    split = with_weight_split(ModelProfile(2, layers))
    assert [(l.input_grad_ms, l.weight_grad_ms) for l in split.layers] == [(2.0, 2.0), (4.0, 0.0), (3.0, 1.0)]
    assert "estimated" in split.meta["backward_split"]


def test_auto_recompute_picks_the_cheapest_setting_that_fits() -> None:
    profile = uniform_profile(8)
    plan = straight_plan(8, [2, 4, 6], 32, 8)
    cluster = Cluster(1, 4, device_memory_gib=16.0)
    roomy = apply_ooo_recompute(plan, profile, cluster, recompute="auto")
    assert [s.recompute for s in roomy.stages] == ["never"] * 4
    never_memory = roomy.extra["memory"]["stages"][0]["memory_bytes"]
    budget = 0.6 * never_memory
    tight = apply_ooo_recompute(plan, profile, cluster, recompute="auto", memory_budget_bytes=budget)
    modes = [s.recompute for s in tight.stages]
    assert modes[0] != "never" and modes[-1] == "never"  # the last stage holds one micro-batch
    memory, _, _, _ = stage_memory(tight, profile, cluster)
    assert all(m <= budget for m in memory)
    assert tight.predicted is not None and tight.predicted.simulated_latency_ms > roomy.predicted.simulated_latency_ms
    data = json.loads(tight.to_json())
    assert [s.get("recompute", "never") for s in data["stages"]] == modes
    assert "stage 0 recomputes" in data["reason"]
    assert data["extra"]["memory"]["budget_bytes"] == budget
    assert plan_from_dict(data).stages == tight.stages
    assert schedule_for_plan(plan_from_dict(data)).in_flight_caps == tuple(data["ooo_in_flight"]) == tight.ooo_in_flight



def test_in_flight_caps_are_a_plan_field_saved_compared_validated_and_read_from_old_files() -> None:
    base = {**PLANS["3-stage"], "global_batch_size": 12, "micro_batches": 3, "ooo": True}
    plan = plan_from_dict({**base, "ooo_in_flight": [3, 0, -1]})
    assert plan.ooo_in_flight == (3, 0, -1)
    assert json.loads(plan.to_json())["ooo_in_flight"] == [3, 0, -1] and "extra" not in json.loads(plan.to_json())
    assert plan_from_dict(json.loads(plan.to_json())) == plan
    # plans that differ only in their caps run different action lists: they are not equal
    assert plan != replace(plan, ooo_in_flight=(3, 0, 0)) and plan != replace(plan, ooo_in_flight=None)
    # a file written when the caps lived in extra loads into the field
    old = plan_from_dict({**base, "extra": {"ooo_in_flight": [3, 0, -1], "memory": {}}})
    assert old == plan and old.extra == {"memory": {}}
    assert schedule_for_plan(old).in_flight_caps[1:] == (0, -1)
    with pytest.raises(DappleConfigError, match=r"plan\.ooo_in_flight: has 2 entries for 3 stages"):
        plan_from_dict({**base, "ooo_in_flight": [3, 0]})
    with pytest.raises(DappleConfigError, match=r"plan\.ooo_in_flight\[2\]: is -2"):
        plan_from_dict({**base, "ooo_in_flight": [3, 0, -2]})
    with pytest.raises(DappleConfigError, match=r"plan\.ooo_in_flight: is \[3, 'x', 0\]"):
        plan_from_dict({**base, "ooo_in_flight": [3, "x", 0]})


def embedding_profile() -> ModelProfile:
    """A big first layer (an embedding, a bucket of its own), a layer without parameters,
    and layers small enough to share buckets."""
    layers = [LayerProfile("emb", 0.5, 1.0, 1e6, 4e9, 1e6, backward_input_ms=0.5, backward_weight_ms=0.5)]
    layers += [LayerProfile("act", 0.2, 0.4, 1e6, 0.0, 1e6, backward_input_ms=0.4, backward_weight_ms=0.0)]
    layers += [LayerProfile(f"l{i}", 1.0, 2.0, 1e6, 1e7, 1e6, backward_input_ms=1.0, backward_weight_ms=1.0) for i in range(8)]
    return ModelProfile(4, tuple(layers), input_bytes=1e6)


def test_ooo_allreduce_buckets_are_bucket_layers_launched_in_order() -> None:
    """Under ooo a replicated stage's ALLREDUCE actions are ``bucket_layers``' buckets, in
    its order; the simulator starts each after the W part completing its layers, after the
    previous bucket, at the cost model's bucket time, and the step ends with the last."""
    from lightning_dapple.plan.buckets import bucket_layers

    profile = embedding_profile()
    plan = Plan(16, 4, (StagePlan((0, 6), (0, 1)), StagePlan((6, 10), (2, 3))), ooo=True)
    cluster = load_cluster("paper-a")
    schedule = schedule_for_plan(plan.with_warmups(), profile)
    costs = stage_costs(with_weight_split(profile), cluster, plan.stages, plan.micro_batch_size)
    result = simulate_plan(plan, profile, cluster)
    for s, stage in enumerate(plan.stages):
        sizes = [layer.param_bytes for layer in profile.layers[stage.start : stage.end]]
        expected = bucket_layers(sizes, 0, len(sizes))
        assert len(expected) >= 2, "the case must have several buckets"
        actions = schedule.actions[s]
        reduces = [(i, a) for i, a in enumerate(actions) if a.kind is Kind.ALLREDUCE]
        assert [a.layers for _, a in reduces] == expected
        # each bucket comes right after the W part finishing its last layer (or after the bucket before)
        for (position, action), previous in zip(reduces, [None, *reduces[:-1]]):
            before = actions[position - 1]
            lo, _ = action.layers
            assert (before.kind is Kind.W and before.layers == (lo, lo + 1)) or (previous is not None and position == previous[0] + 1)
        spans = result.transfers[f"AR{s}"]
        durations = [duration for _, duration in costs[s].buckets if duration > 0]
        assert [span.end_ms - span.start_ms for span in spans] == pytest.approx(durations)
        w_ends = {span_layers: span.end_ms for span_layers, span in zip(
            [a.layers for a in schedule.compute(s) if a.kind is Kind.W], [sp for sp in result.stages[s].spans if sp.kind == "W"]
        )}
        ready = [w_ends[(lo, lo + 1)] for lo, _ in expected if sum(sizes[lo:_]) > 0]
        for index, span in enumerate(spans):
            assert span.start_ms == pytest.approx(max(ready[index], spans[index - 1].end_ms if index else 0.0))
        last_compute = max(sp.end_ms for sp in result.stages[s].spans if sp.kind != "AR")
        assert result.stages[s].end_ms == pytest.approx(max(last_compute, spans[-1].end_ms))
        assert spans[0].start_ms < last_compute  # the first buckets overlap the ending W parts


def test_conventional_ending_order_is_fastest_with_bucket_order() -> None:
    """Buckets launch in ``bucket_layers`` order, so Algorithm 2's k > 0 cannot start any
    bucket earlier; the planner keeps the conventional order and it is never slower."""
    profile = embedding_profile()
    plan = Plan(16, 4, (StagePlan((0, 6), (0, 1)), StagePlan((6, 10), (2, 3))))
    cluster = load_cluster("paper-a")
    chosen = apply_ooo_recompute(plan, profile, cluster, recompute="never")
    assert not chosen.first_k
    best = simulate_plan(chosen, profile, cluster).latency_ms
    for k in range(2, 7):
        assert simulate_plan(replace(chosen, first_k=k), profile, cluster).latency_ms >= best - 1e-9
    assert simulate_plan(replace(chosen, first_k=4), profile, cluster).latency_ms > best  # a layer's part after its bucket's
    plain = simulate_plan(replace(plan, ooo=False), profile, cluster).latency_ms
    assert best < plain
    assert chosen.predicted is not None and chosen.predicted.simulated_latency_ms == pytest.approx(best)


@pytest.mark.timeout(300)
def test_executor_launches_the_simulators_buckets_in_order() -> None:
    """The executor's ``GradientSync`` buckets of a replicated stage under ooo, in the
    order it launches them in a training step, are the schedule's ALLREDUCE buckets built
    from the same parameter sizes (empty buckets, which the executor skips, left out)."""
    from equivalence_worker import make_model
    from ooo_buckets_worker import launched_buckets
    from ooo_worker import with_options

    model = make_model("mlp")
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model]
    profile = ModelProfile(4, tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, float(b), 1e3) for i, b in enumerate(sizes)))
    base = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, len(sizes)], "devices": [0, 1]}]}
    cases = []
    for first_k in (None, 2):
        for bucket_bytes in (1000, 700):
            data = {**with_options(base, "dapple", True, "never"), "first_k": first_k}
            cases.append(("mlp", data, bucket_bytes))
    results = run_ranks(launched_buckets, 2, cases, timeout_s=240, raise_on_error=True)
    for index, (_, data, bucket_bytes) in enumerate(cases):
        plan = plan_from_dict(data)
        schedule = schedule_for_plan(plan, profile, bucket_bytes)
        simulated = [a.layers for a in schedule.actions[0] if a.kind is Kind.ALLREDUCE]
        expected = [(lo, hi) for lo, hi in simulated if sum(sizes[lo:hi]) > 0]
        assert len(expected) >= 3, "the case must have several buckets"
        for rank in (0, 1):
            got = results[rank][index]
            assert got["split"], "ooo: the stage defers W"
            assert [tuple(r) for r in got["launched"]] == expected, (data, bucket_bytes)
            assert got["early"] == len(expected)  # each launched once its last W was done


# Plans DAPPLE's planner chose (plan_dapple on paper-a: BERT-48 with a global batch of 64,
# GNMT-16 with 1024); fixed here because planning takes longer than this file may run.
# benchmarks/bench_ooo.py --simulated plans them afresh.
PAPER_PLANS = {
    "bert-48-pbs-2.txt": {"global_batch_size": 64, "micro_batches": 4, "stages": [
        {"layers": [0, 30], "devices": list(range(8))}, {"layers": [30, 53], "devices": list(range(8, 16))}]},
    "gnmt-16-pbs-64.txt": {"global_batch_size": 1024, "micro_batches": 2, "stages": [
        {"layers": [0, 74], "devices": list(range(8))}, {"layers": [74, 96], "devices": list(range(8, 16))}]},
}


@pytest.mark.parametrize("name", sorted(PAPER_PLANS))
def test_paper_plans_are_not_slower_with_ooo(name: str) -> None:
    from lightning_dapple.profile.loader import load_profile

    data = PAPER_PLANS[name]
    profile = load_profile(PROFILES / name)
    cluster = load_cluster("paper-a")
    plan = plan_from_dict(data)
    plain = simulate_plan(plan, profile, cluster)
    ooo = apply_ooo_recompute(plan, profile, cluster, recompute="never")
    faster = simulate_plan(ooo, profile, cluster)
    assert faster.latency_ms <= plain.latency_ms
    assert faster.bubble_fraction < plain.bubble_fraction


def test_cli_ooo_shows_the_difference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = uniform_profile(8)
    profile_path = tmp_path / "p.json"
    profile_path.write_text(profile.to_json())
    plan_path = tmp_path / "plan.json"
    straight_plan(8, [2, 4, 6], 32, 8).save(plan_path)
    args = ["--profile", str(profile_path), "--plan", str(plan_path), "--cluster", "1x4"]
    assert simulate_main([*args, "--ooo"]) == 0
    out = capsys.readouterr().out
    assert "with ooo" in out and "without" in out and "W ms" in out and "recompute" in out
    assert simulate_main([*args, "--ooo", "--json", "--recompute", "auto", "--memory-gib", "0.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ooo"] is True and data["latency_ms"] <= data["without_ooo"]["latency_ms"] + 1e-9
    assert "always" in data["recompute"] or "except_last" in data["recompute"]


# --------------------------------------------------------------------------- executor

MODES = ("never", "always", "except_last")


def _executor_cases() -> list[tuple[str, dict, str]]:
    from ooo_worker import with_options

    cases: list[tuple[str, dict, str]] = []
    for model in ("mlp", "transformer"):
        for name, plan in PLANS.items():
            base = {"global_batch_size": 12, "micro_batches": 3, **plan}
            for schedule in ("dapple", "gpipe"):
                for ooo in (False, True):
                    for mode in MODES:
                        cases.append((model, with_options(base, schedule, ooo, mode), f"{model}/{name}/{schedule}/{ooo}/{mode}"))
            for ooo in (False, True):
                for mode in MODES:
                    cases.append((f"{model}-dropout", with_options(base, "dapple", ooo, mode), f"{model}-dropout/{name}/dapple/{ooo}/{mode}"))
            if name == "3-stage":  # per-stage deferral: cap K_0, none (W right after B), no split
                data = {**with_options(base, "dapple", True, ["always", "never", "except_last"]), "ooo_in_flight": [3, 0, -1]}
                cases.append((model, data, f"{model}/{name}/dapple/True/mixed/caps"))
            if name in ("2x2", "3:1"):  # reverse first-k ending on replicated stages (Algorithm 2)
                data = {**with_options(base, "dapple", True, "except_last"), "first_k": 2}
                cases.append((model, data, f"{model}/{name}/dapple/True/except_last/k2"))
            if name in ("straight-2", "2x2"):
                cases.append((f"{model}-dropout", with_options(base, "gpipe", True, "always"), f"{model}-dropout/{name}/gpipe/True/always"))
    return cases


def _budget_case() -> tuple[Plan, float, ModelProfile]:
    """A plan of the 'wide' model whose budget is below what 'never' needs."""
    from ooo_worker import make_batch, make_model
    from lightning_dapple.profile.profiler import profile_layers

    layers = make_model("wide")
    profile = profile_layers(layers, make_batch("mlp", 0)[0][:3], repeats=1, warmup=0)
    plan = straight_plan(5, [3], 12, 4)
    cluster = Cluster(1, 2)
    # the least memory each mode can need: without the B/W split
    never = stage_memory(apply_ooo_recompute(plan, profile, cluster, ooo=False, recompute="never"), profile, cluster)[0]
    always = stage_memory(apply_ooo_recompute(plan, profile, cluster, ooo=False, recompute="always"), profile, cluster)[0]
    budget = (never[0] + always[0]) / 2  # stage 0 does not fit without recomputation, whatever ooo does
    assert always[0] < budget < never[0] and never[1] <= budget
    chosen = apply_ooo_recompute(plan, profile, cluster, recompute="auto", memory_budget_bytes=budget)
    return chosen, budget, profile


@pytest.mark.timeout(300)
def test_executor_variants() -> None:
    from ooo_worker import base_name, make_batch, make_model, run_cases
    from lightning_dapple.profile.profiler import profile_layers

    cases = _executor_cases()
    budget_plan, budget, wide_profile = _budget_case()
    assert budget_plan.stages[0].recompute != "never"
    work = [(model, data) for model, data, _ in cases] + [("wide", budget_plan.to_dict())]
    results = run_ranks(run_cases, 4, work, timeout_s=280)
    assert "__errors__" not in results, results.get("__errors__")

    def per_rank(index: int) -> list[dict]:
        return [results[r][index] for r in range(4) if results[r][index] is not None]

    def gap(a: dict, b: dict) -> float:
        return max(abs(x - y) for x, y in zip(a["params"], b["params"]))

    # (1) every schedule x ooo x recompute equals single-device training
    by_label = {label: index for index, (_, _, label) in enumerate(cases)}
    for index, (model, data, label) in enumerate(cases):
        ranks = per_rank(index)
        assert ranks, label
        if "dropout" not in model:
            for res in ranks:
                assert res["param_diff"] < 1e-10 and res["loss_diff"] < 1e-10, (label, res["param_diff"], res["loss_diff"])
        plan = plan_from_dict(data)
        schedule = schedule_for_plan(plan)
        for rank, res in zip(range(4), ranks):
            assert res["recomputed"] == len(schedule.recomputed(res["stage"])), label
            assert ("W" in res["kinds"]) == bool(schedule.compute(res["stage"]) and any(a.kind is Kind.W for a in schedule.compute(res["stage"]))), label
            assert ("W" in res["kinds"]) == (plan.ooo and (plan.ooo_in_flight or (0,) * 4)[res["stage"]] >= 0), label
    # dropout: every variant gives the parameters of the same plan without ooo/recompute
    for model in ("mlp-dropout", "transformer-dropout"):
        for name in PLANS:
            base = per_rank(by_label[f"{model}/{name}/dapple/False/never"])
            for ooo in (False, True):
                for mode in MODES:
                    other = per_rank(by_label[f"{model}/{name}/dapple/{ooo}/{mode}"])
                    for a, b in zip(base, other):
                        assert gap(a, b) < 1e-10, (model, name, ooo, mode)
            if f"{model}/{name}/gpipe/True/always" in by_label:
                gpipe = per_rank(by_label[f"{model}/{name}/gpipe/True/always"])
                for a, b in zip(base, gpipe):  # per-micro-batch seeds: the schedule does not matter either
                    assert gap(a, b) < 1e-10, (model, name, "gpipe")
            # dropout is active: the same plan without dropout ends elsewhere
            plain = per_rank(by_label[f"{base_name(model)}/{name}/dapple/False/never"])
            assert max(gap(a, b) for a, b in zip(base, plain)) > 1e-6

    # peak stashed bytes within the planner's estimate (equal when nothing is deferred)
    profiles: dict[str, ModelProfile] = {}
    cluster = Cluster(1, 4)
    for index, (model, data, label) in enumerate(cases):
        plan = plan_from_dict(data)
        if "dropout" in model or any(plan.micro_batch_size % stage.replicas for stage in plan.stages):
            continue
        if model not in profiles:
            sample = make_batch(base_name(model), 0)[0][: plan.micro_batch_size]
            profiles[model] = profile_layers(make_model(model), sample, repeats=1, warmup=0)
        _, estimate, _, _ = stage_memory(plan, profiles[model], cluster)
        for rank in range(plan.world_size):
            res = results[rank][index]
            assert res["peak_stash_bytes"] <= estimate[res["stage"]] + 1e-6, (label, rank, res["peak_stash_bytes"], estimate)
            if not plan.ooo and all(s.recompute == "never" for s in plan.stages):
                assert res["peak_stash_bytes"] == pytest.approx(estimate[res["stage"]], rel=1e-9)

    # (4) the budget plan: auto recomputation, runs within the budget, same parameters
    index = len(cases)
    memory, estimate, _, _ = stage_memory(budget_plan, wide_profile, Cluster(1, 2))
    for rank in range(budget_plan.world_size):
        res = results[rank][index]
        assert res["param_diff"] < 1e-10, res["param_diff"]
        stage = res["stage"]
        weights = memory[stage] - estimate[stage]
        assert res["peak_stash_bytes"] <= estimate[stage] + 1e-6
        assert weights + res["peak_stash_bytes"] <= budget
