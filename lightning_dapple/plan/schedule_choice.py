"""``schedule="auto"``: run the plan's devices and M under the fastest schedule that fits.

DAPPLE's planner (sec. 4) chooses stages, replication and M for its early-backward
schedule; its formula (4.1) and its re-ranking price that one schedule. Other schedules
leave smaller bubbles at the same M: interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2)
divides the warm-up and cool-down by the number of chunks per device group, ZB-V (Qi et
al., zero bubble pipeline parallelism) fills them with deferred weight gradients; GPipe
(gpipe.txt sec. 2) holds all M micro-batches but needs no warm-up rule. None of them is
best everywhere (chunks add transfers and stash, GPipe stashes M micro-batches), and the
simulator prices each exactly, so the choice is made by simulating every schedule the
plan's shape allows and keeping the fastest that fits the device memory:

* ``dapple`` and ``gpipe`` on the planner's stages, each finished as the run would finish
  it (``finish``: the strategy's out-of-order and recomputation choices, as for any plan);
  one device group (DP, or one device) has no pipeline, so it stays ``dapple``;
* with two device groups or more, ``interleaved`` with v = 2, 3, ... chunks per group (the
  layers cut by ``plan.chunk_cut``; v grows while it simulates faster and every chunk still
  gets a layer) and ``zbv`` (2 chunks in a V);
* the same chunked schedules on the *straight shape* (every device its own group, same M)
  when the planner's pipeline replicates a stage. Chunking shrinks exactly the cost that
  makes DAPPLE replicate stages instead of pipelining them (the bubble, traded in 4.1
  against AllReduce), and the straight shape is the one with the largest bubble, so it is
  the shape whose ranking chunking can change most. A DP plan is not re-shaped: its M was
  chosen with no pipeline to feed (often 1), so a pipeline would need M searched again. Other
  shapes would need the search itself to price chunked schedules (it prices 1F1B's
  formula 2); their bubbles lie between these two.

A candidate is priced by the layer that owns the simulator (``simulate.plan_and_schedule.price_plan``:
``check_plan_fits``, ``stage_memory`` and ``simulate_plan``, the checks and prices every
plan gets). It "fits" when every device's memory (``stage_memory``: for a device group
holding several stages, the weights of all of them and the peak of one stash walk over
the group's merged order; plus its NCCL communicators' reserve where the planner priced
one, ``extra["communicators"]``) is within ``cluster.device_memory_bytes``. Chunks on
the planner's device groups keep the group's ZeRO level. If none fits, the
planner's own plan is kept, as before. The plan's ``reason`` gains one sentence naming
the winner, what it beat and by how much; ``extra["schedule_choice"]`` holds every
candidate's numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.chunk_cut import chunked_stages
from lightning_dapple.plan.communicators import communicator_memory
from lightning_dapple.plan.costs import StageCost, dapple_latency
from lightning_dapple.plan.plan import POLICIES, SCHEDULES, Plan
from lightning_dapple.plan.schedule_table import DEFAULT_SCHEDULE, schedule_spec
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["AUTO_SCHEDULE", "RUNNABLE_SCHEDULES", "Candidate", "Pricing", "choose_schedule", "price_candidate", "schedule_candidates"]

AUTO_SCHEDULE = "auto"
#: simulated steps closer than this fraction are a tie, reported as such
TIE = 5e-4
#: the schedules ``schedule="auto"`` chooses among: those the executor runs
RUNNABLE_SCHEDULES: tuple[str, ...] = SCHEDULES

#: a plan as the run would finish it (out-of-order and recomputation choices) before pricing
Finisher = Callable[[Plan], Plan]
#: a plan's simulated step, memory bytes per stage and stage costs, as the executor would
#: run it (``simulate.plan_and_schedule.price_plan``, given by the layer that owns the simulator);
#: raises ``DappleConfigError`` for a plan it cannot run
SchedulePricer = Callable[[Plan, ModelProfile, Cluster], "tuple[Any, Sequence[float], Sequence[StageCost]]"]


@dataclass(frozen=True)
class Candidate:
    """One schedule tried: its plan, simulated step and peak device memory, or why not."""

    schedule: str
    chunks: int
    straight: bool
    plan: Plan | None = None
    latency_ms: float | None = None
    memory_bytes: float | None = None
    problem: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.latency_ms is not None and not self.problem

    @property
    def label(self) -> str:
        name = f"{self.schedule} x{self.chunks}" if schedule_spec(self.schedule).chunked and schedule_spec(self.schedule).fixed_chunks is None else self.schedule
        return f"{name} on the straight shape" if self.straight else name

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schedule": self.schedule, "chunks": self.chunks, "straight": self.straight, "fits": self.fits}
        if self.latency_ms is not None:
            out["simulated_ms"] = self.latency_ms
        if self.memory_bytes is not None:
            out["memory_bytes"] = self.memory_bytes
        if self.problem:
            out["problem"] = self.problem
        if self.plan is not None:
            out["kind"] = self.plan.kind()
            out["policy"] = self.plan.policy
        return out


def choose_schedule(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    price: SchedulePricer,
    schedules: Sequence[str] = RUNNABLE_SCHEDULES,
    finish: Finisher | None = None,
) -> Plan:
    """``plan``'s devices and M under the fastest of ``schedules`` that fits (see the
    module docstring); ``plan`` is the planner's, with one stage per device group, and
    ``price`` simulates and sizes a plan.

    ``finish`` turns a candidate into what the run would execute (the strategy's ooo and
    recompute choices) before it is priced; the plan returned is finished too.
    """
    require(bool(schedules), "schedules", "is empty", f"give some of {list(SCHEDULES)}")
    for name in schedules:
        require(name in SCHEDULES, "schedule", f"{name!r} is not a schedule", f"use 'auto' or one of {list(SCHEDULES)}")
    candidates = list(schedule_candidates(plan, profile, cluster, price, schedules, finish))
    fitting = [candidate for candidate in candidates if candidate.fits]
    if not fitting:
        why = schedule_reason(candidates, None) if candidates else f"the plan has one device group ({plan.kind()}), with no pipeline to chunk"
        require(DEFAULT_SCHEDULE in schedules, "schedule", f"none of {list(schedules)} can run this plan: {why}", "name another schedule or leave it to 'auto'")
        kept = finish(plan) if finish is not None else plan
        return _with_choice(kept, candidates, None)
    best = min(fitting, key=lambda candidate: candidate.latency_ms)  # first listed on a tie: dapple before the others
    assert best.plan is not None
    return _with_choice(best.plan, candidates, best)


def schedule_candidates(
    plan: Plan, profile: ModelProfile, cluster: Cluster, price: SchedulePricer, schedules: Sequence[str], finish: Finisher | None = None
) -> Iterator[Candidate]:
    """Every schedule tried for ``plan``, priced, in the order of the module docstring."""
    groups = plan.device_groups
    pricing = Pricing(profile, cluster, price, finish, float(plan.extra.get("communicators", {}).get("reserve_bytes", 0.0)))
    require(plan.chunks == 1, "plan", f"has {plan.chunks} stages per device group", "give the planner's plan (one stage per group)")
    straight_names = [name for name in SCHEDULES if not schedule_spec(name).chunked]
    for name in straight_names if len(groups) > 1 else [DEFAULT_SCHEDULE]:  # one group has no pipeline: DP or one device
        if name in schedules:
            bare = plan if name == plan.schedule else _rescheduled(plan, name)
            yield price_candidate(Candidate(name, 1, False, bare), pricing)
    if len(groups) < 2:
        return
    shapes = [(groups, False)]
    straight = tuple(sorted((rank,) for group in groups for rank in group))
    if len(straight) > len(groups):
        shapes.append((straight, True))
    chunked = [schedule_spec(name) for name in SCHEDULES if schedule_spec(name).chunked and name in schedules]
    for shape, is_straight in shapes:
        for spec in chunked:
            if spec.fixed_chunks is None:
                yield from _interleaved(plan, shape, is_straight, pricing, spec.name)
            else:
                yield _chunked(plan, shape, is_straight, spec.name, spec.fixed_chunks, pricing)


def _interleaved(plan: Plan, groups: tuple[tuple[int, ...], ...], straight: bool, pricing: "Pricing", name: str) -> Iterator[Candidate]:
    """Interleaved with 2, 3, ... chunks per group while each simulates faster than the last
    and the layers allow a chunk of at least one layer each."""
    previous: float | None = None
    chunks = 2
    while chunks * len(groups) <= pricing.profile.num_layers:
        candidate = _chunked(plan, groups, straight, name, chunks, pricing)
        yield candidate
        if not candidate.fits or (previous is not None and candidate.latency_ms >= previous):  # type: ignore[operator]
            return
        previous, chunks = candidate.latency_ms, chunks + 1


def _chunked(
    plan: Plan,
    groups: tuple[tuple[int, ...], ...],
    straight: bool,
    schedule: str,
    chunks: int,
    pricing: "Pricing",
) -> Candidate:
    """A ``schedule`` plan with ``chunks`` stages per group of ``groups``, priced under the
    plan's K policy, or, where the planner chose the policy (``extra["policy_choice"]``),
    under the faster fitting one of P_A and P_B (P_A on a tie, as ``policy_choice``)."""
    try:
        stages = chunked_stages(pricing.profile, groups, schedule, chunks, plan.micro_batch_size)
    except DappleConfigError as exc:
        return Candidate(schedule, chunks, straight, problem=_problem(exc))
    sharded = {stage.devices: stage.zero for stage in plan.stages}  # a device group keeps its ZeRO level in every chunk
    stages = tuple(replace(stage, zero=sharded.get(stage.devices, 0) if stage.replicas > 1 else 0) for stage in stages)
    policies = POLICIES if "policy_choice" in plan.extra else (plan.policy,)
    tried = []
    for policy in policies:
        bare = Plan(plan.global_batch_size, plan.micro_batches, stages, schedule=schedule, policy=policy, planner=plan.planner, reason=plan.reason)
        tried.append(price_candidate(Candidate(schedule, chunks, straight, bare.with_warmups()), pricing))
    fitting = [candidate for candidate in tried if candidate.fits]
    return min(fitting, key=lambda candidate: candidate.latency_ms) if fitting else tried[0]  # type: ignore[arg-type, return-value]


def _rescheduled(plan: Plan, schedule: str) -> Plan:
    """``plan``'s stages and M under ``schedule``, its K_i refilled for it."""
    stages = tuple(replace(stage, warmup=None) for stage in plan.stages)
    return replace(plan, schedule=schedule, stages=stages, ooo=False, ooo_in_flight=None).with_warmups()


@dataclass(frozen=True)
class Pricing:
    """What pricing a candidate needs: the model, the devices, the pricer and the finisher."""

    profile: ModelProfile
    cluster: Cluster
    price: SchedulePricer
    finish: Finisher | None = None
    communicator_bytes: float = 0.0  # each NCCL communicator's device memory (plan.communicators)


def price_candidate(candidate: Candidate, pricing: Pricing) -> Candidate:
    """``candidate`` finished, validated, its device memory and step simulated; a candidate
    the run could not execute or that needs more memory than the devices have says why."""
    assert candidate.plan is not None
    try:
        plan = pricing.finish(candidate.plan) if pricing.finish is not None else candidate.plan
        simulation, memory, costs = pricing.price(plan, pricing.profile, pricing.cluster)
    except DappleConfigError as exc:
        return replace(candidate, plan=None, problem=_problem(exc))
    reserve = communicator_memory(plan, pricing.communicator_bytes, pricing.profile.tied, pricing.cluster.num_devices)
    memory = [each + extra for each, extra in zip(memory, reserve)]  # chunks hold more links: more communicators
    peak = max(memory)  # a device's bytes: a stage's entry is its device group's (all its chunks)
    formula = dapple_latency(costs, plan.micro_batches, memory)
    predicted = replace(formula, simulated_latency_ms=simulation.latency_ms, bubble_fraction=simulation.bubble_fraction)
    plan = replace(plan, predicted=predicted)
    budget = pricing.cluster.device_memory_bytes
    problem = f"needs {_gib(peak)} per device, more than {_gib(budget)}" if peak > budget else ""
    return replace(candidate, plan=plan, latency_ms=float(simulation.latency_ms), memory_bytes=peak, problem=problem)


def _with_choice(plan: Plan, candidates: Sequence[Candidate], best: Candidate | None) -> Plan:
    """``plan`` with the choice recorded: one sentence in ``reason``, every candidate's
    numbers in ``extra["schedule_choice"]``."""
    sentence = schedule_reason(candidates, best)
    base = plan.reason.rstrip()
    reason = f"{base}{'' if base.endswith('.') else '.'} {sentence}" if base else sentence
    record = {"chosen": best.label if best is not None else None, "candidates": [c.summary() | {"label": c.label} for c in candidates]}
    return replace(plan, reason=reason, extra={**plan.extra, "schedule_choice": record})


def schedule_reason(candidates: Sequence[Candidate], best: Candidate | None) -> str:
    """'Schedule zbv: 41.2 ms simulated, beat dapple 55.0 ms (+33%), ...; did not fit: ...'."""
    beaten = [c for c in candidates if c.fits and c is not best]
    misfit = [c for c in candidates if c.problem and c.latency_ms is not None]
    invalid = [c for c in candidates if c.latency_ms is None]
    if best is None:
        text = "Schedule dapple kept: no schedule fits the device memory"
    else:
        assert best.latency_ms is not None
        kind = f" ({best.plan.kind()})" if best.plan is not None and (best.straight or best.chunks > 1) else ""
        text = f"Schedule {best.label}{kind}: {best.latency_ms:.2f} ms simulated"
        tied = [c for c in beaten if c.latency_ms <= best.latency_ms * (1 + TIE)]
        slower = [c for c in beaten if c not in tied]
        if slower:
            text += ", beat " + ", ".join(f"{c.label} {c.latency_ms:.2f} ms (+{_percent(c.latency_ms, best.latency_ms)})" for c in slower)
        if tied:  # e.g. every schedule at the bound of processes sharing cores (simulate.cores)
            text += ", tied with " + ", ".join(f"{c.label} {c.latency_ms:.2f} ms" for c in tied) + f" ({best.label} is listed first)"
    if misfit:
        text += "; did not fit: " + ", ".join(f"{c.label} ({c.latency_ms:.2f} ms, {c.problem})" for c in misfit)
    if invalid:
        text += "; not possible: " + ", ".join(f"{c.label} ({c.problem})" for c in invalid)
    return text + "."


def _problem(error: DappleConfigError) -> str:
    return f"{error.field} {error.problem}"


def _percent(slower: float | None, faster: float) -> str:
    return f"{100.0 * ((slower or 0.0) / faster - 1.0):.0f}%" if faster > 0 else "n/a"


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB / 16 else f"{num_bytes / 2**20:.1f} MiB"
