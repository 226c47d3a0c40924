"""How far DAPPLE's latency formula is from the simulated step, and why.

The planner ranks plans by DAPPLE's closed formula L = T_w + T_s + T_e (dapple-ppopp21.txt
sec. 4.1, formulas 1-2, pivot Q from Algorithm 1 of sec. 4.3); the simulator
(``simulate/engine.py``) *runs* the same schedule on the same per-stage costs
(``plan.costs.stage_costs``), so any difference is the formula's own simplification.

``fidelity_row`` prices one plan both ways and splits the difference exactly along the
pivot's simulated timeline (``decompose``), with Q the pivot phase (a computation stage, or
a communication stage, which 4.1 counts as a stage of its own):

    simulated - formula = start delay + idle inside Q - act/grad overlap on Q + tail excess

"idle inside Q" is the pivot bubble the paper says formulas 1-2 ignore, split by what Q waits
for; "overlap" is the time a communication pivot moves an activation and a gradient at once;
"tail excess" is how much the simulated ending phase outlasts T_e - B_Q. A row off by more
than 10 % gets the dominant term as its cause and, for the bubbles, the steady-period bound
that paces the pipeline instead of Q (``Pacing``, DAPPLE 3.2 and 5.3).

``random_instance`` is the stream of small random planning problems this analysis and the
planner's optimality test share (``random_rows`` plans and decomposes them).
``benchmarks/bench_fidelity.py`` runs the analysis over those and every shared profile and
writes the tables.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import StageCost, dapple_latency, pipeline_phases, pivot_stage, stage_costs
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.engine import SimulationResult
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan

SEED = 20240601
THRESHOLD = 0.10
EPS = 1e-9
Phase = tuple[float, float, float]


# --------------------------------------------------------------------------- instances

SHAPES = [(1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (2, 4), (8, 1), (2, 3), (2, 4), (1, 8)]


def random_instance(rng: random.Random) -> tuple[ModelProfile, Cluster, int, int | None]:
    n = rng.randint(2, 8)
    machines, per = rng.choice(SHAPES)
    pbs = rng.choice([1, 2, 4])
    layers = []
    for i in range(n):
        f = rng.uniform(0.5, 10)
        layers.append(
            LayerProfile(
                f"l{i}",
                f,
                f * rng.uniform(1, 3),
                rng.choice([1e5, 1e6, 1e7, 5e7]),
                rng.choice([0, 1e6, 1e7, 1e8, 5e8]),
                rng.choice([1e6, 1e7, 1e8]),
            )
        )
    profile = ModelProfile(pbs, tuple(layers))
    cluster = Cluster(
        machines,
        per,
        intra_bandwidth_gbps=rng.choice([100, 300, 2400]),
        inter_bandwidth_gbps=rng.choice([1, 10, 25, 100]),
        device_memory_gib=rng.choice([2, 4, 16, 64]),
    )
    gbs = pbs * rng.choice([8, 16, 32, 64])
    micro_batches = rng.choice([None, None, 2, 4, 8])
    if micro_batches and gbs % micro_batches:
        micro_batches = None
    return profile, cluster, gbs, micro_batches


def random_instances(count: int, seed: int = SEED) -> Iterator[tuple[int, ModelProfile, Cluster, int, int | None]]:
    """(index, profile, cluster, global batch, M or None) of the ``random_instance`` stream."""
    rng = random.Random(seed)
    for index in range(count):
        yield (index, *random_instance(rng))


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
    m = plan.micro_batches
    phases = pipeline_phases(costs, m)
    owners = phase_owners(costs)
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
