"""Why DAPPLE's formula (sec. 4.1, formulas 1-2) and the simulator differ by more than 10%.

``simulate/fidelity.py`` (run by ``benchmarks/bench_fidelity.py``) compares the planner's
formula with the discrete-event simulator on the optimality test's random instances and on
every shared profile, splits each difference exactly along the pivot's simulated timeline and names the term that carries it.
Each test below builds the smallest case of one such cause and checks the mechanism on the
timeline, not just the size of the gap:

* the pivot starved by a heavier earlier stage that Algorithm 1 (sec. 4.3) leaves unpicked
  when M is small;
* the pivot starved by an in-flight loop: K_i (sec. 5.3) counts computation stages only, so
  K_0 micro-batches cannot cover a round trip that also crosses a link;
* a communication pivot (4.1 counts the transfer as a stage) whose activation and gradient
  transfers overlap on the simulator's two links: the formula then *over*-estimates;
* a communication pivot whose links idle while the in-flight loop paces the pipeline;
* an ending-phase backlog on a heavier stage that holds all M micro-batches (M <= K_u).

The bubble the paper itself names -- the pivot waiting before its first backward for the
round trip behind it -- is pinned in ``tests/test_simulator.py``
(``test_formula_misses_bubbles_inside_a_middle_pivot_stage``); here it is only checked that the
decomposition reads that case the same way.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest
from conftest import shared_profiles

from lightning_dapple.plan.costs import StageCost, dapple_latency, pipeline_phases, pivot_stage
from lightning_dapple.schedule import build_schedule
from lightning_dapple.simulate import SimulationResult, fidelity, simulate
from stage_costs import cost

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    formula: float
    sim: SimulationResult
    parts: Any  # fidelity.Decomposition
    pace: Any  # fidelity.Pacing
    owners: list[tuple[str, int]]
    q: int

    @property
    def rel(self) -> float:
        return self.formula / self.sim.latency_ms - 1

    def spans(self, stage: int, kind: str | None = None) -> list[Any]:
        return [s for s in self.sim.stages[stage].spans if kind is None or s.kind == kind]


def run(costs: Sequence[StageCost], micro_batches: int, warmups: Sequence[int] | None = None) -> Case:
    """Formula (Algorithm 1's pivot) and early-backward simulation of ``costs``, decomposed."""
    phases = pipeline_phases(costs)
    owners = fidelity.phase_owners(costs)
    q = pivot_stage(phases, micro_batches)
    formula = dapple_latency(costs, micro_batches).latency_ms
    schedule = build_schedule("dapple", len(costs), micro_batches, warmups)
    sim = simulate(schedule, costs)
    parts = fidelity.decompose(phases, owners, micro_batches, q, formula, sim)
    assert parts.residual == pytest.approx(0.0, abs=1e-9)
    pace = fidelity.pacing(phases, owners, schedule.warmups, micro_batches, q)
    return Case(formula, sim, parts, pace, owners, q)


def only_term(case: Case, key: str) -> float:
    """The one non-zero term of the decomposition; asserts it carries the whole gap."""
    terms = {k: v for k, v in case.parts.terms().items() if abs(v) > 1e-9}
    assert list(terms) == [key], terms
    assert terms[key] == pytest.approx(case.sim.latency_ms - case.formula)
    return terms[key]


def idle_gaps(case: Case, stage: int) -> list[tuple[float, str, int]]:
    """(idle ms, kind, micro-batch) of the compute that ends each wait on ``stage``."""
    spans = case.spans(stage)
    return [(b.start_ms - a.end_ms, b.kind, b.microbatch) for a, b in zip(spans, spans[1:]) if b.start_ms - a.end_ms > 1e-9]


# --------------------------------------------------------------------------- causes


def test_pivot_starved_by_a_heavier_earlier_stage_when_m_is_small() -> None:
    """Stage 0 takes 3.99 ms per micro-batch, stage 1 3 ms. At M = 4 Algorithm 1 keeps the
    pivot at stage 1 ((M-1) x 0.99 < the 3 ms of stage 1 it would drop), but under early
    backward stage 0 emits a forward only every F_0 + B_0: stage 1 waits 0.99 ms before each
    steady-phase forward, M - 2 times, and that is the whole gap."""
    heavy, light = cost(1.33, 2.66), cost(1.0, 2.0)
    case = run([heavy, light], 4)
    assert case.owners[case.q] == ("stage", 1)
    assert case.rel < -0.10
    gap = only_term(case, "pivot-bubble/starved")
    waits = idle_gaps(case, 1)
    assert [kind for _, kind, _ in waits] == ["F", "F"]
    assert [idle for idle, _, _ in waits] == pytest.approx([heavy.compute_ms - light.compute_ms] * 2)
    assert gap == pytest.approx(2 * (heavy.compute_ms - light.compute_ms))
    assert (case.pace.binding, case.pace.heaviest_stage) == ("heavier-stage", 0)
    # with more micro-batches Algorithm 1 moves the pivot to the heavy stage: within 10%
    many = run([heavy, light], 16)
    assert many.owners[many.q] == ("stage", 0)
    assert abs(many.rel) < 0.05


def test_pivot_starved_by_the_in_flight_loop_through_a_link() -> None:
    """Two equal stages (F+B = 3 ms) joined by a 1 ms link. Under P_A stage 0 holds K_0 = 2
    micro-batches, but micro-batch j's round trip F_0 + send + F_1 + B_1 + send + B_0 takes
    8 ms: stage 0 can start F(j+2) only 8 ms after F(j), a period of 4 ms, not the pivot's
    3 ms. Stage 1 idles 1 ms per steady micro-batch waiting for activations. Without the
    link, or with P_B's K_0 = 3 (DAPPLE 5.3: deeper warm-up to overlap communication), the
    formula is exact."""
    costs = [cost(1.0, 2.0, send=1.0), cost(1.0, 2.0)]
    m = 16
    case = run(costs, m)
    assert case.owners[case.q] == ("stage", 1)
    assert case.rel < -0.10
    gap = only_term(case, "pivot-bubble/starved")
    assert all(kind == "F" for _, kind, _ in idle_gaps(case, 1))
    round_trip = costs[0].compute_ms + 2 * costs[0].send_ms + costs[1].compute_ms
    assert (case.pace.binding, case.pace.loop_span) == ("in-flight-loop", (0, 1))
    assert case.pace.loop_ms == pytest.approx(round_trip / 2)
    forwards = [s.start_ms for s in case.spans(1, "F")]
    assert [b - a for a, b in zip(forwards, forwards[2:])] == pytest.approx([round_trip] * (m - 2))
    assert gap == pytest.approx((m - 2) * (round_trip / 2 - costs[1].compute_ms))
    assert case.sim.stages[0].peak_in_flight == 2
    assert run([cost(1.0, 2.0), cost(1.0, 2.0)], m).rel == pytest.approx(0.0, abs=1e-12)
    assert run(costs, m, warmups=[3, 1]).rel == pytest.approx(0.0, abs=1e-12)


def _overlap(a: Sequence[Any], b: Sequence[Any]) -> float:
    return sum(max(0.0, min(x.end_ms, y.end_ms) - max(x.start_ms, y.start_ms)) for x in a for y in b)


def test_communication_pivot_overlaps_activations_and_gradients() -> None:
    """A 4 ms transfer between two 3 ms stages: 4.1 makes it a stage with F = B = 4 ms, the
    pivot, and charges (M-1)(F+B) = 8 ms per micro-batch. The simulator has one link per
    direction, and every time an activation and a gradient are in flight at once the formula
    counts twice: formula - simulated equals exactly the time the two links are both busy."""
    costs = [cost(1.0, 2.0, send=4.0), cost(1.0, 2.0)]
    m = 8
    case = run(costs, m)
    assert case.owners[case.q] == ("link", 0)
    assert case.rel > 0.10
    gap = only_term(case, "comm-pivot/duplex-overlap")
    act, grad = case.sim.transfers["0->1"], case.sim.transfers["1->0"]
    assert len(act) == len(grad) == m
    assert all(s.end_ms - s.start_ms == pytest.approx(4.0) for s in [*act, *grad])
    assert -gap == pytest.approx(_overlap(act, grad)) and -gap > 0
    assert case.parts.idle_link == 0.0


def test_communication_pivot_idles_while_the_in_flight_loop_paces() -> None:
    """A 1.75 ms link between 3 ms stages: the transfer stage (3.5 ms) is the pivot, but the
    K_0 = 2 loop needs (3 + 3.5 + 3) / 2 = 4.75 ms per micro-batch, so the links wait for
    compute between transfers and the formula under-estimates by that idle time."""
    costs = [cost(1.0, 2.0, send=1.75), cost(1.0, 2.0)]
    m = 16
    case = run(costs, m)
    assert case.owners[case.q] == ("link", 0)
    assert case.rel < -0.10
    gap = case.sim.latency_ms - case.formula
    assert gap == pytest.approx(case.parts.idle_link - case.parts.overlap)
    assert fidelity.dominant_term(case.parts) == "comm-pivot/link-idle"
    assert case.pace.binding == "in-flight-loop"
    assert case.pace.loop_ms == pytest.approx((3.0 + 3.5 + 3.0) / 2)
    issued = sorted(s.start_ms for s in case.sim.transfers["0->1"])
    assert [b - a for a, b in zip(issued[2:], issued[4:])] == pytest.approx([2 * case.pace.loop_ms] * (m - 4))


def test_ending_backlog_of_a_heavier_stage_holding_every_micro_batch() -> None:
    """M = 2 = K_0: stage 0 (F+B = 5.8 ms) runs both forwards, then both backwards. Algorithm 1
    keeps the lighter last stage as pivot (5.8 < 2 x 3 ms), and T_e charges stage 0 one
    backward after the pivot's last; but stage 0 is still running B(0) when the last gradient
    arrives, so that gradient waits in its queue -- exactly the gap."""
    heavy, light = cost(1.0, 4.8), cost(1.0, 2.0)
    case = run([heavy, light], 2)
    assert case.owners[case.q] == ("stage", 1)
    assert case.rel < -0.10
    gap = only_term(case, "ending/backlog")
    assert [s.kind for s in case.spans(0)] == ["F", "F", "B", "B"]
    arrival = case.spans(1, "B")[-1].end_ms  # no link: the gradient arrives as B_1 ends
    queued = case.spans(0, "B")[-1].start_ms - arrival
    assert queued == pytest.approx(gap) and queued > 0
    assert (case.pace.binding, case.pace.heaviest_stage) == ("heavier-stage", 0)


def test_decomposition_reads_the_documented_middle_pivot_bubble() -> None:
    """test_simulator's 6-stage case (middle stage twice as heavy, M = 4, 9 ms gap): seen from
    the middle stage, the 9 ms are idle before its first backward (the bubble 4.1 ignores);
    from Algorithm 1's pivot (the last stage, a tie at M = 4) the same 9 ms show as backlog in
    the ending. Either way one term carries it all and the heavy stage paces."""
    costs = [cost(1.0, 4.0)] * 2 + [cost(2.0, 8.0)] + [cost(1.0, 4.0)] * 3
    case = run(costs, 4)
    assert case.owners[case.q] == ("stage", 5)
    assert only_term(case, "ending/backlog") == pytest.approx(9.0)
    assert case.pace.heaviest_stage == 2
    phases = pipeline_phases(costs)
    middle = fidelity.formula_with_pivot(phases, 4, 2)
    parts = fidelity.decompose(phases, case.owners, 4, 2, middle, case.sim)
    assert parts.idle_first_grad == pytest.approx(9.0)
    assert parts.gap == pytest.approx(parts.idle_first_grad)


# --------------------------------------------------------------------------- the random instances


@pytest.fixture(scope="module")
def random_rows() -> list[Any]:
    rows, _ = fidelity.random_rows(240)
    return rows


def test_random_instances_fidelity(random_rows: list[Any]) -> None:
    """The optimality test's 240 instances (213 with a valid plan). The report measured 192
    (90.1%) within 10%. 85% leaves room for the planner to pick a different one of two
    near-equal plans; a cost term that formula and simulator priced differently, or a broken
    pivot rule, would show up as start delays or busy mismatches (asserted zero) and as a
    drop far larger than that."""
    assert len(random_rows) >= 200
    within = sum(1 for row in random_rows if abs(row.rel) <= 0.10)
    assert within >= 0.85 * len(random_rows), f"{within}/{len(random_rows)} within 10%"
    for row in random_rows:
        parts = row.decomposition
        scale = max(1.0, row.simulated_ms)
        assert abs(parts.residual) <= 1e-9 * scale, row.name
        assert abs(parts.start_delay) <= 1e-9 * scale, row.name
        assert abs(parts.busy_error) <= 1e-9 * scale, row.name


def test_formula_exceeds_the_simulation_only_through_a_communication_pivot(random_rows: list[Any]) -> None:
    """With a computation pivot, formulas 1-2 follow work the schedule has to do one after the
    other (forwards to Q, Q's M F+B, backwards from Q), so the simulation can only be longer.
    The formula comes out above it only when a transfer is the pivot and the simulator's two
    links overlap what the formula serialises -- on every instance, at any size of gap (the
    report finds the same on all 81 profile rows). Every > 10% gap has a named mechanism."""
    mechanisms = set(fidelity.CAUSES) - {"start-delay", "busy-mismatch"}
    for row in random_rows:
        if row.rel > 1e-9:
            assert row.decomposition.pivot_kind == "link", row.name
            assert row.decomposition.overlap > 0, row.name
    over = [row for row in random_rows if abs(row.rel) > 0.10]
    assert over
    for row in over:
        assert row.cause in mechanisms, (row.name, row.cause)
        if row.rel > 0:
            assert row.cause == "comm-pivot/duplex-overlap", row.name


def test_pacing_bound_is_the_measured_steady_period(random_rows: list[Any]) -> None:
    """``Pacing``'s largest bound (a stage, a link, or a K_u - K_w + 1 loop through the
    stages and links u..w) is the period the simulated pivot actually runs at, wherever the
    steady phase is long enough to measure (M >= 16)."""
    measured = [(row.name, row.period_ms / row.pace.period_ms) for row in random_rows if row.period_ms is not None and row.stages > 1]
    assert len(measured) >= 15  # 18 pipelines with M >= 16 among the 240 (DP wins more often with overlapped AllReduce)
    assert all(abs(ratio - 1) <= 0.02 for _, ratio in measured), measured


# --------------------------------------------------------------------------- the script


def test_budget_skips_are_reported_not_dropped_and_the_deadline_interrupts_planning(tmp_path: Path) -> None:
    """The script, run as users run it: a budget far below the first profile's planning time
    (about 0.4 s for AmoebaNet-18 on paper-a) interrupts that planning, and every profile is
    still listed, as skipped, in the JSON and the markdown."""
    out, md = tmp_path / "f.json", tmp_path / "f.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_fidelity.py"), "--instances", "3", "--budget-s", "0.05"]
    command += ["--clusters", "paper-a", "--out", str(out), "--md", str(md)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    profiles = sorted((shared_profiles() / "dapple").glob("*.txt")) + sorted((shared_profiles() / "pipedream").glob("*.txt"))
    assert data["profiles"] == [] and len(data["profiles_skipped"]) == len(profiles) > 0
    reasons = [item["reason"] for item in data["profiles_skipped"]]
    assert "did not finish" in reasons[0], reasons[0]
    assert all("budget" in reason for reason in reasons)
    assert md.read_text().count("| skipped |") == len(profiles)
    assert time.perf_counter() - start < 120.0
