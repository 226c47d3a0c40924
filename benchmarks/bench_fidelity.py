"""Fidelity: the planner's formula (DAPPLE 4.1, formulas 1-2) against the discrete-event simulator.

    python benchmarks/bench_fidelity.py                      # 240 random instances + every profile x paper-a/b/c
    python benchmarks/bench_fidelity.py --budget-s 120 --clusters paper-a
    python benchmarks/bench_fidelity.py --out benchmarks/results/fidelity.json --md benchmarks/results/fidelity.md

The planner ranks plans by DAPPLE's closed formula L = T_w + T_s + T_e (sec. 4.1, formulas
1-2, pivot Q from Algorithm 1 of sec. 4.3); the simulator (``lightning_dapple.simulate``)
*runs* the same schedule on the same per-stage costs. Both sides use ``plan.costs.stage_costs``,
so any difference is the formula's own simplification, never a different cost model.

Rows come from (1) the random instances of ``tests/test_planner_optimality.py`` (same
generator, same seed 20240601, default 240 instances: up to 8 layers, up to 2 machines x 4
devices or 8 flat devices), each planned by ``make_plan(..., min_slice=1)`` as the optimality
test plans them, and (2) every profile in shared/profiles/ (dapple/ and pipedream/) on the
paper's clusters, planned by ``make_plan`` with the Table-4 global batch of the model family.
Plans are made with policy P_A, the K_i the search sizes memory with, so that every row
prices one schedule; ``policy="auto"`` (the planner's default) runs a plan with P_B where that
simulates faster, which the P_B column below shows per cause.

Each row is decomposed exactly (``decompose``): with Q the pivot phase (a computation stage,
or a communication stage, which 4.1 counts as a stage of its own),

    simulated - formula = start delay + idle inside Q - act/grad overlap on Q + tail excess

where "idle inside Q" is the pivot bubble the paper says formula 1-2 ignores, split by what Q
waits for; "overlap" is the time a communication pivot moves an activation and a gradient at
once (the simulator has one link per direction, the formula runs a communication stage's F
and B back to back); "tail excess" is how much the simulated ending phase outlasts T_e - B_Q.
A row whose formula is off by more than 10% gets the dominant term as its cause and, for the
bubbles, the steady-period bound that paces the pipeline instead of Q (``Pacing``: a heavier
stage Algorithm 1 left unpicked, or an "in-flight loop" -- a cycle of the early-backward
schedule through stages u..w and their links that advances only K_u - K_w + 1 micro-batches,
DAPPLE 5.3). Two checks back the explanation with the simulator itself: the pivot's measured
steady period against that bound (M >= 16), and each > 10% row re-simulated with policy P_B's
deeper warm-up (5.3), which the paper introduces to overlap communication.

Profiles are planned under a wall-clock budget (``--budget-s``); what does not fit is listed
as skipped in the table, the JSON and the markdown, never dropped.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

from rich.console import Console
from rich.table import Table

from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.simulate.plans import make_plan
from lightning_dapple.plan.costs import StageCost, dapple_latency, pipeline_phases, pivot_stage, stage_costs
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate import SimulationResult, simulate_plan

REPO = Path(__file__).resolve().parents[1]
SEED = 20240601
THRESHOLD = 0.10
EPS = 1e-9
CLUSTERS = ("paper-a", "paper-b", "paper-c")
Phase = tuple[float, float, float]

# Global batch per model family: DAPPLE Table 4 where the paper plans the model (VGG-19 2048,
# GNMT-16 1024, BERT-48 64, XLNet-36 128, AmoebaNet-36 128); siblings take their family's
# batch, and every image model takes VGG-19's.
FAMILY_BATCH = (("gnmt", 1024), ("bert", 64), ("xlnet", 128), ("amoeba", 128))
IMAGE_BATCH = 2048
GRAPH_PBS = 64  # PipeDream's graph files without pbs-N in the name are batch 64 (profiles README)


# --------------------------------------------------------------------------- inputs


def shared_profiles() -> Path:
    """shared/profiles beside the checkout (as CI clones it), else the workplace copy."""
    beside = REPO.parent / "shared" / "profiles"
    return beside if beside.is_dir() else Path("/work/shared/profiles")


def optimality_module() -> ModuleType:
    """``tests/test_planner_optimality.py`` loaded from its path.

    The acceptance point asks for "the same instances" as the optimality test, so the
    generator is imported, not copied; ``tests`` is not a package (pytest puts it on
    sys.path itself), so it is loaded by file path rather than ``import tests...``.
    """
    path = REPO / "tests" / "test_planner_optimality.py"
    spec = importlib.util.spec_from_file_location("_fidelity_optimality_instances", path)
    assert spec is not None and spec.loader is not None, path
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def random_instances(count: int, seed: int = SEED) -> Iterator[tuple[int, ModelProfile, Cluster, int, int | None]]:
    """(index, profile, cluster, global batch, M or None) of the optimality test's stream."""
    generate = optimality_module().random_instance
    rng = random.Random(seed)
    for index in range(count):
        yield (index, *generate(rng))


def profile_files() -> list[Path]:
    root = shared_profiles()
    return sorted(root.glob("dapple/*.txt")) + sorted(root.glob("pipedream/*.txt"))


def batch_for(path: Path) -> int:
    """The global batch a profile is planned with (Table 4 conventions, see FAMILY_BATCH)."""
    name = path.name.lower()
    for family, batch in FAMILY_BATCH:
        if family in name:
            return batch
    return IMAGE_BATCH


def read_profile(path: Path) -> ModelProfile:
    """Graph files without ``pbs-N`` in the name are batch 64 (shared/profiles/README.md)."""
    return load_profile(path, None if re.search(r"pbs-\d+", path.name) else GRAPH_PBS)


# --------------------------------------------------------------------------- the formula


def formula_with_pivot(phases: Sequence[Phase], micro_batches: int, q: int) -> float:
    """DAPPLE formulas 1-2 with the pivot forced to phase ``q``.

    The same sums as ``costs.dapple_latency`` (warm-up F_0..F_Q, (M-1)(F_Q+B_Q), ending
    max_s AR_s + backward tail); ``fidelity_row`` checks the two agree at Algorithm 1's Q,
    and uses other Q to tell a pivot-choice gap from a bubble no pivot accounts for.
    """
    warmup = sum(phase[0] for phase in phases[: q + 1])
    steady = (micro_batches - 1) * (phases[q][0] + phases[q][1])
    ending = 0.0
    for s, (_, _, allreduce) in enumerate(phases):
        if s <= q:
            tail = sum(phase[1] for phase in phases[s : q + 1])
        else:
            tail = -sum(phase[1] for phase in phases[q + 1 : s + 1])
        ending = max(ending, allreduce + tail)
    return warmup + steady + ending


def phase_owners(costs: Sequence[StageCost]) -> list[tuple[str, int]]:
    """For each phase of ``pipeline_phases``: ("stage", s) or ("link", s) for boundary s->s+1."""
    owners: list[tuple[str, int]] = []
    for s, cost in enumerate(costs):
        owners.append(("stage", s))
        if s + 1 < len(costs) and cost.send_ms > 0:
            owners.append(("link", s))
    return owners


# --------------------------------------------------------------------------- decomposition


@dataclass
class Decomposition:
    """simulated - formula, split into what the timeline of the pivot phase Q shows.

    gap = start_delay + idle - overlap + busy_error + tail (exact up to float rounding;
    ``residual`` is what is left). ``idle`` is split by what Q waits for:

    * ``idle_first_grad``: a computation pivot waiting for micro-batch 0's gradient before
      its first backward (its K_Q warm-up forwards do not cover the round trip behind it);
    * ``idle_act``: waiting for an activation from the stage before it;
    * ``idle_grad``: waiting for a later gradient, after its first backward;
    * ``idle_link``: a communication pivot's links both idle (waiting for compute).
    """

    pivot_phase: int
    pivot_kind: str
    pivot_index: int
    start_delay: float
    idle_first_grad: float
    idle_act: float
    idle_grad: float
    idle_link: float
    overlap: float
    busy_error: float
    tail: float
    gap: float

    @property
    def idle(self) -> float:
        return self.idle_first_grad + self.idle_act + self.idle_grad + self.idle_link

    @property
    def residual(self) -> float:
        return self.gap - (self.start_delay + self.idle - self.overlap + self.busy_error + self.tail)

    def terms(self) -> dict[str, float]:
        """Signed contributions to simulated - formula, by cause key (see CAUSES)."""
        return {
            "pivot-bubble/first-gradient": self.idle_first_grad,
            "pivot-bubble/starved": self.idle_act,
            "pivot-bubble/gradient-wait": self.idle_grad,
            "comm-pivot/link-idle": self.idle_link,
            "comm-pivot/duplex-overlap": -self.overlap,
            "ending/backlog": self.tail,
            "start-delay": self.start_delay,
            "busy-mismatch": self.busy_error,
        }


CAUSES = {
    "pivot-bubble/first-gradient": "pivot bubble: before its first backward the pivot waits for micro-batch 0's gradient "
    "(its K_Q warm-up forwards do not cover the round trip through the stages and links behind it)",
    "pivot-bubble/starved": "pivot bubble: the pivot waits for activations; an earlier stage, alternating F and B under "
    "early backward, delivers forwards slower than F_Q + B_Q",
    "pivot-bubble/gradient-wait": "pivot bubble: inside its steady phase the pivot waits for gradients from the stages behind it",
    "comm-pivot/link-idle": "communication pivot: its links idle while waiting for compute (formula 2 assumes they never do)",
    "comm-pivot/duplex-overlap": "communication pivot: activations and gradients cross the boundary at the same time on "
    "separate links; the formula charges (M-1)(F+B) of the communication stage as if one after the other",
    "ending/backlog": "ending phase: an earlier stage still has queued backwards (or its AllReduce) after the pivot's "
    "last backward; T_e charges each stage one backward",
    "start-delay": "the pivot's first forward starts later than sum F_0..F_{Q-1}",
    "busy-mismatch": "the pivot's simulated work differs from M (F_Q + B_Q)",
}


def _union(intervals: Sequence[tuple[float, float]]) -> list[list[float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1] + EPS:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _pivot_intervals(sim: SimulationResult, kind: str, index: int) -> list[tuple[float, float]]:
    """Busy intervals of the pivot: a stage's F/B/W spans, or both directions of a link."""
    if kind == "stage":
        return [(s.start_ms, s.end_ms) for s in sim.stages[index].spans if s.kind in ("F", "B", "W")]
    links = (f"{index}->{index + 1}", f"{index + 1}->{index}")
    return [(s.start_ms, s.end_ms) for link in links for s in sim.transfers.get(link, [])]


def _stage_idle(sim: SimulationResult, stage: int) -> tuple[float, float, float]:
    """(before first B waiting for a gradient, waiting for activations, later gradient waits)."""
    spans = [s for s in sim.stages[stage].spans if s.kind in ("F", "B", "W")]
    first_grad = act = grad = 0.0
    seen_backward = False
    for earlier, later in zip(spans, spans[1:]):
        idle = later.start_ms - earlier.end_ms
        seen_backward = seen_backward or earlier.kind == "B"
        if idle <= EPS:
            continue
        if later.kind == "F":
            act += idle
        elif seen_backward:
            grad += idle
        else:
            first_grad += idle
    return first_grad, act, grad


def decompose(phases: Sequence[Phase], owners: Sequence[tuple[str, int]], micro_batches: int, q: int, formula: float, sim: SimulationResult) -> Decomposition:
    """Split simulated - formula (DAPPLE formulas 1-2 at pivot phase ``q``) along Q's timeline.

    The formula's Q starts its first forward at sum_{p<Q} F_p, is busy M(F_Q+B_Q) without a
    gap and is followed by T_e - B_Q. The terms measure those assumptions on the simulated
    timeline: the start, Q's idle time and (a link pivot) overlap plus any difference in
    its busy time, and the time after Q's last busy interval.
    """
    kind, index = owners[q]
    merged = _union(_pivot_intervals(sim, kind, index))
    busy_sum = sum(end - start for start, end in _pivot_intervals(sim, kind, index))
    busy_union = sum(end - start for start, end in merged)
    first, last = merged[0][0], merged[-1][1]
    ending = formula - sum(p[0] for p in phases[: q + 1]) - (micro_batches - 1) * (phases[q][0] + phases[q][1])
    idle = (last - first) - busy_union
    first_grad = act = grad = link = 0.0
    if kind == "stage":
        first_grad, act, grad = _stage_idle(sim, index)
    else:
        link = idle
    return Decomposition(
        pivot_phase=q,
        pivot_kind=kind,
        pivot_index=index,
        start_delay=first - sum(p[0] for p in phases[:q]),
        idle_first_grad=first_grad,
        idle_act=act,
        idle_grad=grad,
        idle_link=link,
        overlap=busy_sum - busy_union,
        busy_error=busy_sum - micro_batches * (phases[q][0] + phases[q][1]),
        tail=(sim.latency_ms - last) - (ending - phases[q][1]),
        gap=sim.latency_ms - formula,
    )


# --------------------------------------------------------------------------- pacing


@dataclass
class Pacing:
    """Steady-state bounds (ms per micro-batch) on the pipeline's period, against F_Q + B_Q.

    Formula 2's steady phase assumes the pivot Q paces the pipeline: one micro-batch per
    F_Q + B_Q. Under early backward (DAPPLE 3.2, K_i of 5.3) stage i runs B(j) right before
    F(j + K_i). Follow micro-batch j's forwards from stage u to stage w, the stage order
    at w from F_w(j) to B_w(j - K_w + 1), the backwards back to u and the order at u to
    F_u(j - K_w + 1 + K_u): a cycle that comes back K_u - K_w + 1 micro-batches later and
    holds F + B of every stage and link from u to w. So the period is at least

        max over u <= w of  sum_{phases u..w} (F_p + B_p) / (K_u - K_w + 1)

    (only stages with K_u < M have a steady phase). A single stage (u = w) gives its own
    F + B: a ``heavier-stage`` than Q, which Algorithm 1 leaves unpicked when
    (M-1)(F_u+B_u - F_Q-B_Q) is less than the work between u and Q (small M). A longer
    segment is an ``in-flight-loop``: K_u - K_w + 1 counts computation stages only (P_A:
    K_i = S - i), while the links inside the segment, which 4.1 counts as stages of their
    own, add to the round trip; without communication the segment's mean never exceeds
    its heaviest stage. A ``link`` moves one transfer per micro-batch in each direction.
    ``binding`` names the largest bound, ``pivot`` when none exceeds Q's own period.
    """

    pivot_ms: float
    heaviest_stage: int
    heaviest_ms: float
    loop_span: tuple[int, int]
    loop_ms: float
    link_ms: float

    @property
    def binding(self) -> str:
        bounds = {"pivot": self.pivot_ms, "heavier-stage": self.heaviest_ms, "in-flight-loop": self.loop_ms, "link": self.link_ms}
        top = max(bounds.values())
        if bounds["pivot"] >= top * (1 - 1e-9):
            return "pivot"
        return max(bounds, key=lambda key: bounds[key])

    @property
    def period_ms(self) -> float:
        """The largest bound: the steady period the simulated pipeline cannot beat."""
        return max(self.pivot_ms, self.heaviest_ms, self.loop_ms, self.link_ms)


def segment_bounds(phases: Sequence[Phase], owners: Sequence[tuple[str, int]], warmups: Sequence[int], micro_batches: int) -> dict[tuple[int, int], float]:
    """sum F+B over the phases of stages u..w (links between included) / (K_u - K_w + 1);
    see ``Pacing``. A single stage (u = w) always bounds the period by its own F+B (it
    runs M of each); a longer segment only when its first stage has a steady phase (K_u < M)."""
    fb = [f + b for f, b, _ in phases]
    at = {index: p for p, (kind, index) in enumerate(owners) if kind == "stage"}
    out: dict[tuple[int, int], float] = {}
    for u in range(len(warmups)):
        out[(u, u)] = fb[at[u]]
        if warmups[u] >= micro_batches:
            continue
        for w in range(u + 1, len(warmups)):
            if warmups[w] <= warmups[u]:
                out[(u, w)] = sum(fb[at[u] : at[w] + 1]) / (warmups[u] - warmups[w] + 1)
    return out


def pacing(phases: Sequence[Phase], owners: Sequence[tuple[str, int]], warmups: Sequence[int], micro_batches: int, q: int) -> Pacing:
    """The bounds of ``Pacing`` for one plan (phases of ``pipeline_phases``, K_i of the plan)."""
    bounds = segment_bounds(phases, owners, warmups, micro_batches)
    singles = {u: value for (u, w), value in bounds.items() if u == w}
    loops = {span: value for span, value in bounds.items() if span[0] != span[1]}
    heaviest = max(singles, key=lambda u: singles[u], default=0)
    loop = max(loops, key=lambda span: loops[span], default=(0, 0))
    kind, _ = owners[q]
    # a communication pivot's own period: one transfer per micro-batch in each direction
    pivot_ms = phases[q][0] + phases[q][1] if kind == "stage" else phases[q][0]
    return Pacing(
        pivot_ms=pivot_ms,
        heaviest_stage=heaviest,
        heaviest_ms=singles.get(heaviest, 0.0),
        loop_span=loop,
        loop_ms=loops.get(loop, 0.0),
        link_ms=max((f for (f, _, _), (kind, _) in zip(phases, owners) if kind == "link"), default=0.0),
    )


def measured_period(sim: SimulationResult, kind: str, index: int, micro_batches: int) -> float | None:
    """Mean spacing of Q's forwards (a link pivot: its activation transfers) over the middle
    half of the micro-batches; None for M < 16, where there is hardly a steady phase."""
    if micro_batches < 16:
        return None
    if kind == "stage":
        starts = sorted(s.start_ms for s in sim.stages[index].spans if s.kind == "F")
    else:
        starts = sorted(s.start_ms for s in sim.transfers.get(f"{index}->{index + 1}", []))
    middle = starts[micro_batches // 4 : 3 * micro_batches // 4 + 1]
    return (middle[-1] - middle[0]) / (len(middle) - 1)


# --------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One planned instance: formula vs simulation, plan shape, decomposition, cause."""

    source: str
    name: str
    cluster: str
    global_batch_size: int
    plan: str
    stages: int
    replicas: list[int]
    micro_batches: int
    warmups: list[int]
    formula_ms: float
    simulated_ms: float
    best_pivot_formula_ms: float
    pivot_stage: int
    decomposition: Decomposition
    pace: Pacing
    period_ms: float | None = None
    simulated_pb_ms: float | None = None
    plan_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rel(self) -> float:
        """formula / simulated - 1: negative when the formula under-estimates."""
        return self.formula_ms / self.simulated_ms - 1.0

    @property
    def cause(self) -> str | None:
        """The dominant term of the decomposition when |rel| > 10%, else None."""
        if abs(self.rel) <= THRESHOLD:
            return None
        return dominant_term(self.decomposition)

    @property
    def paced_by(self) -> str | None:
        """For a bubble or backlog cause: the bound that paces the pipeline instead of Q."""
        cause = self.cause
        if cause is None or cause.startswith("comm-pivot/duplex"):
            return None
        return self.pace.binding

    def to_dict(self) -> dict[str, Any]:
        d = self.decomposition
        return {
            "source": self.source,
            "name": self.name,
            "cluster": self.cluster,
            "global_batch_size": self.global_batch_size,
            "plan": self.plan,
            "stages": self.stages,
            "replicas": self.replicas,
            "micro_batches": self.micro_batches,
            "warmups": self.warmups,
            "formula_ms": self.formula_ms,
            "simulated_ms": self.simulated_ms,
            "rel_diff": self.rel,
            "best_pivot_formula_ms": self.best_pivot_formula_ms,
            "pivot_stage": self.pivot_stage,
            "pivot_phase": {"index": d.pivot_phase, "kind": d.pivot_kind, "of": d.pivot_index},
            "decomposition_ms": {**d.terms(), "residual": d.residual},
            "pacing_ms_per_microbatch": {
                "pivot": self.pace.pivot_ms,
                "heaviest_stage": [self.pace.heaviest_stage, self.pace.heaviest_ms],
                "loop_segment": [*self.pace.loop_span, self.pace.loop_ms],
                "link": self.pace.link_ms,
                "binding": self.pace.binding,
                "bound": self.pace.period_ms,
                "measured": self.period_ms,
            },
            "simulated_with_PB_ms": self.simulated_pb_ms,
            "cause": self.cause,
            "paced_by": self.paced_by,
            "plan_s": self.plan_s,
            **self.extra,
        }


def dominant_term(decomposition: Decomposition) -> str:
    """The term contributing most to the gap, in the gap's direction."""
    terms = decomposition.terms()
    sign = 1.0 if decomposition.gap >= 0 else -1.0
    return max(terms, key=lambda key: sign * terms[key])


def plan_shape(plan: Plan) -> str:
    """'DP', 'single', or layers per stage with replication, e.g. '3x2:5x1'."""
    if plan.num_stages == 1:
        return f"{plan.kind()} x{plan.stages[0].replicas}"
    return ":".join(f"{s.end - s.start}L x{s.replicas}" for s in plan.stages)


def fidelity_row(plan: Plan, profile: ModelProfile, cluster: Cluster, source: str, name: str, plan_s: float = 0.0) -> Row:
    """Formula and simulation of one plan, with the exact decomposition of their difference."""
    plan = plan.with_warmups()
    costs = stage_costs(profile, cluster, plan.stages, plan.micro_batch_size)
    phases = pipeline_phases(costs)
    owners = phase_owners(costs)
    m = plan.micro_batches
    q = pivot_stage(phases, m)
    formula = dapple_latency(costs, m)
    forced = formula_with_pivot(phases, m, q)
    assert abs(forced - formula.latency_ms) <= 1e-9 * max(1.0, formula.latency_ms), (forced, formula.latency_ms)
    if plan.predicted is not None:
        assert abs(plan.predicted.latency_ms - formula.latency_ms) <= 1e-9 * max(1.0, formula.latency_ms), name
    sim = simulate_plan(plan, profile, cluster)
    warmups = [int(stage.warmup or 1) for stage in plan.stages]
    stage_pivots = [p for p, (kind, _) in enumerate(owners) if kind == "stage"]
    pb = None
    if abs(formula.latency_ms / sim.latency_ms - 1) > THRESHOLD:
        pb = simulate_plan(with_policy(plan, "PB"), profile, cluster).latency_ms
    kind, index = owners[q]
    return Row(
        source=source,
        name=name,
        cluster=cluster.name,
        global_batch_size=plan.global_batch_size,
        plan=plan_shape(plan),
        stages=plan.num_stages,
        replicas=[stage.replicas for stage in plan.stages],
        micro_batches=m,
        warmups=warmups,
        formula_ms=formula.latency_ms,
        simulated_ms=sim.latency_ms,
        best_pivot_formula_ms=max(formula_with_pivot(phases, m, p) for p in stage_pivots),
        pivot_stage=formula.pivot_stage,
        decomposition=decompose(phases, owners, m, q, formula.latency_ms, sim),
        pace=pacing(phases, owners, warmups, m, q),
        period_ms=measured_period(sim, kind, index, m),
        simulated_pb_ms=pb,
        plan_s=plan_s,
    )


def with_policy(plan: Plan, policy: str) -> Plan:
    """The same stages and M with the K_i of ``policy`` (DAPPLE 5.3; P_B: K_i = 2(S-i)-1,
    which the paper introduces to overlap cross-stage communication). Memory is not checked:
    this is a counterfactual that tests the in-flight-loop explanation, not a plan."""
    return replace(plan, policy=policy, stages=tuple(replace(stage, warmup=None) for stage in plan.stages)).with_warmups(policy)


def random_rows(count: int, seed: int = SEED) -> tuple[list[Row], list[dict[str, Any]]]:
    """Rows of the optimality test's instances; instances with no valid plan are listed apart."""
    rows, unplannable = [], []
    for index, profile, cluster, gbs, m in random_instances(count, seed):
        start = time.perf_counter()
        try:
            plan = make_plan(profile, cluster, gbs, micro_batches=m, min_slice=1, policy="PA")
        except DappleConfigError as exc:
            unplannable.append({"name": f"instance {index}", "reason": str(exc)[:160]})
            continue
        named = replace(cluster, name=f"{cluster.machines}x{cluster.devices_per_machine}")
        rows.append(fidelity_row(plan, profile, named, "random", f"instance {index}", time.perf_counter() - start))
    return rows, unplannable


class OutOfTime(Exception):
    pass


def with_deadline(seconds: float, work: Callable[[], Plan]) -> Plan:
    """Run ``work`` and raise ``OutOfTime`` if it is still running after ``seconds``.

    The planner is pure Python/NumPy, so a SIGALRM handler can interrupt it; the remaining
    budget thus bounds even a single profile that would not fit.
    """

    def expire(signum: int, frame: Any) -> None:
        raise OutOfTime()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        return work()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def profile_rows(clusters: Sequence[str], budget_s: float, console: Console | None = None) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every profile on every cluster, cluster by cluster (all of paper-a first), within budget."""
    rows: list[Row] = []
    skipped: list[dict[str, Any]] = []
    deadline = time.perf_counter() + budget_s
    root = shared_profiles()
    for cluster_name in clusters:
        cluster = load_cluster(cluster_name)
        for path in profile_files():
            name = str(path.relative_to(root))
            gbs = batch_for(path)
            left = deadline - time.perf_counter()
            base = {"source": "profile", "name": name, "cluster": cluster_name, "global_batch_size": gbs}
            if left <= 0:
                skipped.append({**base, "reason": f"budget of {budget_s:g} s spent before it started"})
                continue
            profile = read_profile(path)
            start = time.perf_counter()
            try:
                plan = with_deadline(left, lambda: make_plan(profile, cluster, gbs, policy="PA"))
            except OutOfTime:
                skipped.append({**base, "reason": f"planning did not finish in the {left:.0f} s of budget left"})
                continue
            except DappleConfigError as exc:
                skipped.append({**base, "reason": f"no valid plan: {str(exc)[:160]}"})
                continue
            row = fidelity_row(plan, profile, cluster, "profile", name, time.perf_counter() - start)
            rows.append(row)
            if console is not None:
                console.print(f"  {name} on {cluster_name}: {row.plan}, M={row.micro_batches}, {100 * row.rel:+.1f}% ({row.plan_s:.1f} s)")
    return rows, skipped


# --------------------------------------------------------------------------- summary


def summarise(rows: Sequence[Row]) -> dict[str, Any]:
    """Counts within 1/5/10% and above, by direction, and the causes of the > 10% gaps."""
    out: dict[str, Any] = {"rows": len(rows)}
    for limit in (0.01, 0.05, 0.10):
        out[f"within_{round(limit * 100)}pct"] = sum(1 for r in rows if abs(r.rel) <= limit)
    over = [r for r in rows if abs(r.rel) > THRESHOLD]
    out["over_10pct"] = len(over)
    out["over_10pct_formula_low"] = sum(1 for r in over if r.rel < 0)
    out["over_10pct_formula_high"] = sum(1 for r in over if r.rel > 0)
    causes: dict[str, int] = {}
    paced: dict[str, int] = {}
    for r in over:
        causes[r.cause or ""] = causes.get(r.cause or "", 0) + 1
        key = f"{r.cause} / paced by {r.paced_by}" if r.paced_by else str(r.cause)
        paced[key] = paced.get(key, 0) + 1
    out["causes"] = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    out["causes_with_pacing"] = dict(sorted(paced.items(), key=lambda kv: -kv[1]))
    out["max_abs_residual_ms"] = max((abs(r.decomposition.residual) for r in rows), default=0.0)
    out["best_pivot_within_10pct_of_over"] = sum(1 for r in over if abs(r.best_pivot_formula_ms / r.simulated_ms - 1) <= THRESHOLD)
    periods = [r.period_ms / r.pace.period_ms - 1 for r in rows if r.period_ms is not None and r.stages > 1]
    out["period_rows"] = len(periods)
    out["period_max_abs_dev"] = max((abs(p) for p in periods), default=0.0)
    return out


def worst(rows: Sequence[Row], count: int = 10) -> list[Row]:
    return sorted(rows, key=lambda r: -abs(r.rel))[:count]


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _terms_text(row: Row) -> str:
    terms = {k: v for k, v in row.decomposition.terms().items() if abs(v) > 1e-6}
    return ", ".join(f"{k} {v:+.1f}" for k, v in sorted(terms.items(), key=lambda kv: -abs(kv[1])))


def print_tables(console: Console, random_: Sequence[Row], profiles: Sequence[Row], skipped: Sequence[dict[str, Any]]) -> None:
    """Rich tables: counts per set, worst random instances, every profile row."""
    counts = Table(title="Formula (DAPPLE 4.1) vs simulator: |formula/simulated - 1|")
    for header in ("set", "rows", "<= 1%", "<= 5%", "<= 10%", "> 10% (formula low / high)"):
        counts.add_column(header)
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        s = summarise(rows)
        counts.add_row(label, str(s["rows"]), str(s["within_1pct"]), str(s["within_5pct"]), str(s["within_10pct"]), f"{s['over_10pct']} ({s['over_10pct_formula_low']} / {s['over_10pct_formula_high']})")
    console.print(counts)
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        causes = summarise(rows)["causes_with_pacing"]
        if causes:
            console.print(f"causes of > 10% gaps, {label}: " + "; ".join(f"{k}: {v}" for k, v in causes.items()))
    table = Table(title="Worst random instances")
    for header in ("instance", "cluster", "plan", "M", "K", "formula", "simulated", "diff", "pivot", "cause", "paced by", "terms (ms)"):
        table.add_column(header)
    for r in worst(random_):
        table.add_row(r.name, r.cluster, r.plan, str(r.micro_batches), str(r.warmups), f"{r.formula_ms:.1f}", f"{r.simulated_ms:.1f}", _pct(r.rel), _pivot_text(r), r.cause or "", r.paced_by or "", _terms_text(r))
    console.print(table)
    table = Table(title="Profiles (shared/profiles)")
    for header in ("profile", "cluster", "GBS", "plan", "M", "formula", "simulated", "diff", "pivot", "cause", "paced by", "plan s"):
        table.add_column(header)
    for r in profiles:
        table.add_row(r.name, r.cluster, str(r.global_batch_size), r.plan, str(r.micro_batches), f"{r.formula_ms:.1f}", f"{r.simulated_ms:.1f}", _pct(r.rel), _pivot_text(r), r.cause or "", r.paced_by or "", f"{r.plan_s:.1f}")
    for item in skipped:
        table.add_row(item["name"], item["cluster"], str(item["global_batch_size"]), "[yellow]skipped[/yellow]", "", "", "", "", "", item["reason"], "", "")
    console.print(table)


def _pb_text(rows: Sequence[Row], against_formula: bool = False) -> str:
    """Median of the P_B simulation relative to the P_A simulation (or to the formula)."""
    changes = sorted(r.simulated_pb_ms / (r.formula_ms if against_formula else r.simulated_ms) - 1 for r in rows if r.simulated_pb_ms is not None)
    return _pct(changes[len(changes) // 2]) if changes else "-"


def _pivot_text(row: Row) -> str:
    d = row.decomposition
    return f"stage {d.pivot_index}" if d.pivot_kind == "stage" else f"link {d.pivot_index}->{d.pivot_index + 1}"


def markdown(random_: Sequence[Row], unplannable: Sequence[dict[str, Any]], profiles: Sequence[Row], skipped: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown summary written next to the JSON."""
    lines = [
        "# Fidelity: planner formula (DAPPLE 4.1, formulas 1-2) vs simulator",
        "",
        f"Generated by `{meta['command']}` in {meta['wall_s']:.0f} s (2-core CPU machine). "
        "diff = formula / simulated - 1 (negative: the formula under-estimates). "
        "Causes come from the exact decomposition simulated - formula = start delay + idle inside the pivot "
        "- act/grad overlap on a communication pivot + ending excess (max |residual| "
        f"{max(summarise([*random_, *profiles])['max_abs_residual_ms'], 0):.1e} ms); see the docstring of "
        "`benchmarks/bench_fidelity.py`.",
        "",
        "| set | rows | <= 1% | <= 5% | <= 10% | > 10% (formula low / high) |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in ((f"random instances (seed {meta['seed']}, {meta['instances']} drawn, {len(unplannable)} without a valid plan)", random_), ("profiles", profiles)):
        s = summarise(rows)
        lines.append(f"| {label} | {s['rows']} | {s['within_1pct']} | {s['within_5pct']} | {s['within_10pct']} | {s['over_10pct']} ({s['over_10pct_formula_low']} / {s['over_10pct_formula_high']}) |")
    lines += [
        "",
        "## Causes of the > 10% gaps",
        "",
        "cause = the decomposition term that carries the gap; paced by = the largest steady-period bound "
        "(`Pacing`); P_B = median change of the simulated step when the same plan runs with P_B's K_i "
        "(DAPPLE 5.3, memory not checked) instead of P_A's; P_B vs formula = median of that simulation / formula - 1.",
        "",
        "| cause | paced by | random | profiles | P_B | P_B vs formula |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[list[Row]]] = {}
    for index, rows in enumerate((random_, profiles)):
        for r in rows:
            if r.cause is not None:
                groups.setdefault((r.cause, r.paced_by or "-"), [[], []])[index].append(r)
    for (cause, paced), (a, b) in sorted(groups.items(), key=lambda kv: -len(kv[1][0]) - len(kv[1][1])):
        lines.append(f"| {cause} | {paced} | {len(a)} | {len(b)} | {_pb_text([*a, *b])} | {_pb_text([*a, *b], against_formula=True)} |")
    keys = groups
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        s = summarise(rows)
        if s["period_rows"]:
            lines.append(
                f"\n{label}: on the {s['period_rows']} pipelined rows with M >= 16 the pivot's measured steady period "
                f"(middle half of the micro-batches) is within {100 * s['period_max_abs_dev']:.1f}% of the largest bound of `Pacing`."
            )
        if s["over_10pct"]:
            lines.append(
                f"\n{label}: of the {s['over_10pct']} rows off by more than 10%, {s['best_pivot_within_10pct_of_over']} would be within "
                "10% had formulas 1-2 used the computation stage with the largest estimate as pivot instead of Algorithm 1's."
            )
    lines += ["", "Cause keys:", ""]
    lines += [f"- `{key}`: {text}" for key, text in CAUSES.items() if any(key == k[0] for k in keys)]
    lines += [
        "- paced by (steady-period bounds, ms per micro-batch; a cycle of the early-backward schedule from stage u "
        "to stage w and back holds F+B of every stage and link in between and advances K_u - K_w + 1 micro-batches): "
        "`heavier-stage`: one stage's F+B exceeds the pivot's (Algorithm 1 keeps a later, lighter pivot when M is small); "
        "`in-flight-loop`: a segment of stages with its links, (sum F+B) / (K_u - K_w + 1), exceeds every single stage "
        "(K_i counts computation stages, the round trip also crosses the links); `link`: one transfer per micro-batch "
        "on the slowest link; `pivot`: nothing exceeds F_Q+B_Q, the bubble is a one-off of the warm-up or ending.",
        "",
        "## Worst random instances",
        "",
        "| instance | cluster | plan | M | K | formula ms | simulated ms | diff | pivot | cause | paced by | terms (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in worst(random_):
        lines.append(f"| {r.name} | {r.cluster} | {r.plan} | {r.micro_batches} | {r.warmups} | {r.formula_ms:.1f} | {r.simulated_ms:.1f} | {_pct(r.rel)} | {_pivot_text(r)} | {r.cause or ''} | {r.paced_by or ''} | {_terms_text(r)} |")
    lines += [
        "",
        "## Profiles",
        "",
        "| profile | cluster | GBS | plan | M | formula ms | simulated ms | diff | pivot | cause | paced by | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in profiles:
        lines.append(f"| {r.name} | {r.cluster} | {r.global_batch_size} | {r.plan} | {r.micro_batches} | {r.formula_ms:.1f} | {r.simulated_ms:.1f} | {_pct(r.rel)} | {_pivot_text(r)} | {r.cause or ''} | {r.paced_by or ''} | {r.plan_s:.1f} |")
    for item in skipped:
        lines.append(f"| {item['name']} | {item['cluster']} | {item['global_batch_size']} | skipped | | | | | | {item['reason']} | | |")
    if unplannable:
        lines += ["", f"Random instances without a valid plan ({len(unplannable)}): " + ", ".join(item["name"].split()[-1] for item in unplannable) + "."]
    return "\n".join(lines) + "\n"


def _rounded(value: Any) -> Any:
    """Floats to 7 significant digits: the JSON stays readable and diffable."""
    if isinstance(value, float):
        return float(f"{value:.7g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, default=240, help="random instances drawn (the optimality test's 240)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget for planning the profiles")
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help="cluster presets for the profiles")
    parser.add_argument("--out", default=None, help="write every row as JSON")
    parser.add_argument("--md", default=None, help="write the markdown summary")
    args = parser.parse_args(argv)
    console = make_console()
    start = time.perf_counter()
    random_, unplannable = random_rows(args.instances, args.seed)
    console.print(f"{len(random_)} random instances planned and simulated ({len(unplannable)} without a valid plan) in {time.perf_counter() - start:.1f} s")
    profiles, skipped = profile_rows(args.clusters, args.budget_s, console)
    wall = time.perf_counter() - start
    print_tables(console, random_, profiles, skipped)
    command = "python benchmarks/bench_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command.strip(), "seed": args.seed, "instances": args.instances, "budget_s": args.budget_s, "clusters": args.clusters, "wall_s": wall, "threshold": THRESHOLD}
    if args.out:
        data = {
            "meta": meta,
            "causes": CAUSES,
            "summary": {"random": summarise(random_), "profiles": summarise(profiles)},
            "random": [r.to_dict() for r in random_],
            "random_unplannable": unplannable,
            "profiles": [r.to_dict() for r in profiles],
            "profiles_skipped": skipped,
        }
        Path(args.out).write_text(json.dumps(_rounded(data), indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(random_, unplannable, profiles, skipped, meta))
    console.print(f"wall time {wall:.0f} s; {len(skipped)} profile row(s) skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
