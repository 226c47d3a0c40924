"""CPU processes that share fewer cores than they are (``cluster.shared_cores``): the step is
no shorter than the machine's compute on its cores (``simulate.cores``), and
``ooo="auto"`` prices the split backward's extra work there instead of the bubbles it fills."""
from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dapple.cluster import Cluster, cluster_from_dict
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.plan import Plan, plan_from_dict
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.cores import shared_core_bound_ms
from lightning_dapple.simulate.engine import COMPUTE_SPANS
from lightning_dapple.strategy.ooo_choice import decide_ooo


def _plan(stages: int, micro_batches: int = 8, ooo: bool = False) -> Plan:
    per = 8 // stages
    return plan_from_dict({
        "global_batch_size": 8 * micro_batches, "micro_batches": micro_batches, "ooo": ooo,
        "stages": [{"layers": [i * per, (i + 1) * per], "devices": [i]} for i in range(stages)],
    })


def _profile(input_ms: float, weight_ms: float) -> ModelProfile:
    """Eight equal layers: F 1 ms, B 2 ms, split into I ``input_ms`` and W ``weight_ms``."""
    layers = tuple(
        LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e3, 1e4, backward_input_ms=input_ms, backward_weight_ms=weight_ms) for i in range(8)
    )
    return ModelProfile(micro_batch_size=8, layers=layers, name="uniform", input_bytes=1e3)


def _work(result) -> float:
    return sum(span.end_ms - span.start_ms for spans in result.timelines.values() for span in spans if span.kind in COMPUTE_SPANS)


def test_four_processes_on_two_cores_take_at_least_their_work_over_two() -> None:
    profile, own = _profile(1.0, 1.0), Cluster(1, 4)
    alone = simulate_plan(_plan(4), profile, own)
    shared = simulate_plan(_plan(4), profile, replace(own, shared_cores=2))
    assert alone.core_bound_ms is None and shared.core_bound_ms == pytest.approx(_work(alone) / 2)
    # the pipeline's path (8 F + 8 B per stage plus warm-up and drain) is shorter than the work / 2
    assert alone.latency_ms < _work(alone) / 2 == pytest.approx(shared.latency_ms)
    assert shared.bubble_fraction == pytest.approx(1 - _work(alone) / (4 * shared.latency_ms))
    assert shared.bubble_fraction == pytest.approx(0.5)  # each process waits while the other of its core runs


def test_a_core_per_process_or_no_sharing_leaves_the_step_alone() -> None:
    profile, own = _profile(1.0, 1.0), Cluster(1, 4)
    alone = simulate_plan(_plan(4), profile, own)
    for cores in (4, 8):
        result = simulate_plan(_plan(4), profile, replace(own, shared_cores=cores))
        assert result.core_bound_ms is None and result.latency_ms == alone.latency_ms
    assert shared_core_bound_ms(alone, own) is None


def test_the_bound_is_per_machine() -> None:
    """Two machines of two processes each, each machine with one core: the busier one sets it."""
    profile = _profile(1.0, 1.0)
    result = simulate_plan(_plan(4), profile, Cluster(2, 2, shared_cores=1))
    alone = simulate_plan(_plan(4), profile, Cluster(2, 2))
    by_machine = [sum(s.end_ms - s.start_ms for d in devices for s in alone.timelines[d] if s.kind in COMPUTE_SPANS) for devices in ((0, 1), (2, 3))]
    assert result.core_bound_ms == pytest.approx(max(by_machine))


def test_ooo_auto_prices_the_split_backwards_extra_work_on_shared_cores() -> None:
    """I + W = 2.4 ms against B = 2 ms: on a core per process ooo fills the pipeline's
    bubbles and wins; on 4 processes sharing 2 cores the extra work is the step's."""
    profile, own = _profile(1.2, 1.2), Cluster(1, 4)
    on, why = decide_ooo("auto", _plan(4), profile, own)
    assert on is True, why
    on, why = decide_ooo("auto", _plan(4), profile, replace(own, shared_cores=2))
    assert on is False and "4 CPU processes share 2 cores" in why
    with_ooo = simulate_plan(_plan(4, ooo=True), profile, replace(own, shared_cores=2))
    without = simulate_plan(_plan(4), profile, replace(own, shared_cores=2))
    assert with_ooo.latency_ms > without.latency_ms


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "two"])
def test_bad_shared_cores_are_refused_with_the_fix(value: object) -> None:
    with pytest.raises(DappleConfigError, match="shared_cores.*positive integer or null"):
        Cluster(1, 4, shared_cores=value)  # type: ignore[arg-type]


def test_shared_cores_round_trip_through_the_cluster_file_form() -> None:
    cluster = Cluster(1, 4, shared_cores=2)
    assert cluster_from_dict(cluster.to_dict()) == cluster
    assert cluster_from_dict({"machines": 1, "devices_per_machine": 4}).shared_cores is None


def test_cpu_processes_are_detected_sharing_this_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dapple import cluster as module

    monkeypatch.setattr(module, "usable_cores", lambda: 2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert module.detect_cluster(1, 4, "cpu").shared_cores == 2
    assert module.detect_cluster(1, 4, "auto").shared_cores == 2
