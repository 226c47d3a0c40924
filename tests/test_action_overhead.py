"""The executor's own time per action: stored in the profile, priced by the simulator and the
cost model, seen by ``ooo="auto"``, and measured by the probe."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from conftest import shared_profiles
from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.overhead_probe import LoopbackWire, measure_action_overhead, with_action_overhead
from lightning_dapple.execute.transfer.transport import Peer, Transport
from lightning_dapple.plan.costs import StageCost, dapple_latency, pipeline_phases, stage_costs
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.profile.action_overhead import NO_OVERHEAD, OVERHEAD_KINDS, ActionOverhead
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.builders import build_schedule
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.engine import simulate
from lightning_dapple.strategy.ooo_choice import decide_ooo

OVERHEAD = ActionOverhead(forward=0.125, backward=0.25, backward_input=0.0625, backward_weight=0.5, send=0.03125, recv=0.015625)


def _profile(overhead: ActionOverhead = NO_OVERHEAD, weight_ms: float = 1.0) -> ModelProfile:
    """Eight equal layers whose backward is 1 ms of input gradient and ``weight_ms`` of weights."""
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 1.0 + weight_ms, 1e3, 1e3, 1e4, backward_input_ms=1.0, backward_weight_ms=weight_ms) for i in range(8)
    )
    return ModelProfile(micro_batch_size=8, layers=layers, name="uniform", input_bytes=1e3, action_overhead_ms=overhead)


def _plan(stages: int, micro_batches: int = 8) -> Plan:
    per = 8 // stages
    return plan_from_dict({
        "global_batch_size": 8 * micro_batches, "micro_batches": micro_batches,
        "stages": [{"layers": [i * per, (i + 1) * per], "devices": [i]} for i in range(stages)],
    })


def _cost(forward: float, backward: float, send: float = 0.0, overhead: ActionOverhead = NO_OVERHEAD, split: bool = False) -> StageCost:
    return StageCost(
        forward_ms=forward, backward_ms=backward, backward_input_ms=backward / 2 if split else backward,
        backward_weight_ms=backward / 2 if split else 0.0, param_bytes=0.0, stash_bytes=0.0, output_bytes=0.0,
        send_ms=send, allreduce_ms=0.0, slice_size=1.0, overhead=overhead,
    )


# --------------------------------------------------------------------------- the profile JSON


def test_profile_json_round_trips_with_and_without_overhead() -> None:
    plain = _profile()
    data = json.loads(plain.to_json())
    assert "action_overhead_ms" not in data  # profiles without it stay as they were
    assert profile_from_dict(data).action_overhead_ms == NO_OVERHEAD
    measured = _profile(OVERHEAD)
    data = json.loads(measured.to_json())
    assert data["action_overhead_ms"] == {"F": 0.125, "B": 0.25, "I": 0.0625, "W": 0.5, "send": 0.03125, "recv": 0.015625}
    assert profile_from_dict(data) == measured
    data["action_overhead_ms"] = {"W": 2}  # a kind left out costs nothing
    assert profile_from_dict(data).action_overhead_ms == ActionOverhead(backward_weight=2.0)


def test_published_profiles_load_without_overhead() -> None:
    published = sorted((shared_profiles() / "dapple").glob("*-pbs-*.txt"))
    assert published
    assert all(load_profile(path).action_overhead_ms == NO_OVERHEAD for path in published)


@pytest.mark.parametrize(
    "value, match",
    [({"F": -1.0}, "finite number >= 0"), ({"F": float("nan")}, "finite number >= 0"), ({"X": 1.0}, "unknown kinds"), ([1.0], "not a JSON object")],
)
def test_bad_overhead_is_refused_with_the_field(value: object, match: str) -> None:
    data = json.loads(_profile().to_json())
    data["action_overhead_ms"] = value
    with pytest.raises(DappleConfigError, match=match) as info:
        profile_from_dict(data)
    assert "action_overhead_ms" in str(info.value)


# --------------------------------------------------------------------------- the simulator


def test_simulator_adds_each_compute_actions_overhead_once() -> None:
    """One stage, M micro-batches of F and B (or F, I, W): every action is longer by its
    kind's overhead, so the step by M times their sum."""
    micro_batches = 4
    for split, schedule in ((False, build_schedule("dapple", 1, micro_batches)), (True, _split_schedule(micro_batches))):
        base = simulate(schedule, [_cost(1.0, 2.0, split=split)]).latency_ms
        priced = simulate(schedule, [_cost(1.0, 2.0, overhead=OVERHEAD, split=split)])
        per_mb = OVERHEAD.forward + (OVERHEAD.backward_input + OVERHEAD.backward_weight if split else OVERHEAD.backward)
        assert priced.latency_ms == pytest.approx(base + micro_batches * per_mb, abs=1e-12)
        forward_spans = [span for span in priced.timelines[0] if span.kind == "F"]
        assert all(span.end_ms - span.start_ms == pytest.approx(1.0 + OVERHEAD.forward) for span in forward_spans)


def _split_schedule(micro_batches: int) -> Schedule:
    actions = [a for mb in range(micro_batches) for a in (Action(Kind.F, 0, mb), Action(Kind.I, 0, mb), Action(Kind.W, 0, mb))]
    return Schedule(name="split", num_stages=1, micro_batches=micro_batches, warmups=(1,), actions=(tuple(actions),))


def test_simulator_charges_sends_and_receives_on_the_path() -> None:
    """Two stages, one micro-batch: F0, send, link, receive, F1, B1, send, link, receive, B0
    run one after another, so the step grows by two of each overhead."""
    schedule = build_schedule("dapple", 2, 1)
    base = simulate(schedule, [_cost(1.0, 1.0, send=0.5), _cost(1.0, 1.0)]).latency_ms
    assert base == pytest.approx(5.0)
    priced = simulate(schedule, [_cost(1.0, 1.0, send=0.5, overhead=OVERHEAD), _cost(1.0, 1.0, overhead=OVERHEAD)]).latency_ms
    extra = 2 * (OVERHEAD.forward + OVERHEAD.backward + OVERHEAD.send + OVERHEAD.recv)
    assert priced == pytest.approx(base + extra, abs=1e-12)


# --------------------------------------------------------------------------- the cost model


def test_cost_model_carries_and_prices_the_overhead() -> None:
    cluster = Cluster(1, 4)
    plan = _plan(2, micro_batches=4)
    plain = stage_costs(_profile(), cluster, plan.stages, 8)
    costs = stage_costs(_profile(OVERHEAD), cluster, plan.stages, 8)
    assert all(cost.overhead == OVERHEAD for cost in costs)
    assert [replace(cost, overhead=NO_OVERHEAD) for cost in costs] == plain  # the compute times stay the layers'
    phases, base = pipeline_phases(costs), pipeline_phases(plain)
    # stage 0 sends its activation and receives its gradient; stage 1 the other way round
    assert phases[0][0] - base[0][0] == pytest.approx(OVERHEAD.forward + OVERHEAD.send)
    assert phases[0][1] - base[0][1] == pytest.approx(OVERHEAD.backward + OVERHEAD.recv)
    assert phases[-1][0] - base[-1][0] == pytest.approx(OVERHEAD.forward + OVERHEAD.recv)
    assert phases[-1][1] - base[-1][1] == pytest.approx(OVERHEAD.backward + OVERHEAD.send)
    one = _plan(1, micro_batches=4)
    grown = dapple_latency(stage_costs(_profile(OVERHEAD), cluster, one.stages, 8), 4).latency_ms
    assert grown - dapple_latency(stage_costs(_profile(), cluster, one.stages, 8), 4).latency_ms == pytest.approx(
        4 * (OVERHEAD.forward + OVERHEAD.backward)
    )


def test_recompute_pays_a_forwards_overhead_again() -> None:
    plan = plan_from_dict({
        "global_batch_size": 16, "micro_batches": 2, "stages": [{"layers": [0, 8], "devices": [0], "recompute": "always"}],
    })
    cost = stage_costs(_profile(OVERHEAD), Cluster(1, 1), plan.stages, 8)[0]
    assert cost.recompute_ms == pytest.approx(cost.forward_ms + OVERHEAD.forward)


# --------------------------------------------------------------------------- ooo="auto"


def test_ooo_auto_turns_off_when_the_weight_actions_cost_more_than_they_save() -> None:
    """Four stages whose weight gradients fill bubbles: ooo pays without overhead; with a W
    and I overhead larger than the bubble it fills, the same plan runs without."""
    cluster, plan = Cluster(1, 4), _plan(4)
    on, why = decide_ooo("auto", plan, _profile(), cluster)
    assert on is True, why
    costly = ActionOverhead(backward_input=0.5, backward_weight=1.0)
    on, why = decide_ooo("auto", plan, _profile(costly), cluster)
    with_ooo = simulate_plan(replace(plan, ooo=True), _profile(costly), cluster).latency_ms
    without = simulate_plan(plan, _profile(costly), cluster).latency_ms
    assert with_ooo > without and on is False, why


# --------------------------------------------------------------------------- the probe


def test_probe_measures_every_kind_finite_and_positive() -> None:
    state = torch.get_rng_state()
    overhead = measure_action_overhead(repeats=5, warmup=1)
    assert torch.equal(torch.get_rng_state(), state)  # profiling leaves the training's random stream alone
    values = overhead.to_dict()
    assert set(values) == set(OVERHEAD_KINDS)
    assert all(math.isfinite(ms) and ms >= 0 for ms in values.values()), values
    # a transfer's time is all overhead (no layer runs); a compute kind is the executor's
    # time less the profiler's, floored at 0, which noise can reach for one kind (B, I and W
    # do little more than the profiler's own autograd call), never for all four
    assert values["send"] > 0 and values["recv"] > 0, values
    assert values["F"] + values["B"] + values["I"] + values["W"] > 0, values
    profile = with_action_overhead(_profile(), "cpu")
    assert profile.layers == _profile().layers and not profile.action_overhead_ms.is_zero


def test_loopback_wire_delivers_what_was_sent() -> None:
    """The probe's transfers run the transport's real code: an activation (and a layout
    change) arrives intact through the loopback."""
    transport = Transport(None, torch.device("cpu"), wire=LoopbackWire(torch.device("cpu")))  # type: ignore[arg-type]
    peers = [Peer(1, (0, 3))]
    for value in (torch.randn(3, 5), torch.randn(3, 5), (torch.randn(3, 2), torch.arange(3))):
        transport.send_activation(value, (0, 3), peers, "x")
        transport.flush()
        got = transport.recv_activation((0, 3), peers, "x")
        expected = value if isinstance(value, tuple) else (value,)
        received = got if isinstance(got, tuple) else (got,)
        assert all(torch.equal(a, b) for a, b in zip(expected, received))


def test_a_hand_off_within_a_device_group_pays_no_transport_overhead() -> None:
    """Stages 0 and 1 on one device group: the boundary between them is an in-process
    hand-off, so only the compute actions pay; the step grows by 2 (F + B)."""
    straight = build_schedule("dapple", 2, 1)
    first, second = straight.actions  # F0 SEND_F0 RECV_B0 B0 / RECV_F0 F0 B0 SEND_B0
    schedule = replace(straight, placement=(0, 0), orders=((*first[:2], *second, *first[2:]),))
    costs = [_cost(1.0, 1.0, send=0.0), _cost(1.0, 1.0)]
    base = simulate(schedule, costs).latency_ms
    priced = simulate(schedule, [replace(cost, overhead=OVERHEAD) for cost in costs]).latency_ms
    assert priced == pytest.approx(base + 2 * (OVERHEAD.forward + OVERHEAD.backward), abs=1e-12)
