"""Which plans ``DappleStrategy(tune_steps=N)`` measures: the simulator's choice and its nearest rivals.

The planner ranks plans by simulating them (DAPPLE 4, re-ranked by the exact schedules).
Where the simulator is off -- CPU processes that share cores, host work it does not price,
a device it has not seen -- the plan it ranks first can run slower than one it ranks
second, and nothing tells the user. DeepSpeed's Autotuner answers the same question for
its configurations by running short trials and keeping the fastest; here the simulator
narrows the trials to a few, and ``plan_tuning.py`` runs them.

The rivals are the simulator's choice changed along one axis at a time, each axis only
where the user left it open:

* the **schedule** (``schedule`` not named): every runnable schedule on the planner's devices
  and M (``plan.schedule_choice``), chunked ones included even where CPU processes share
  cores, since measuring is what settles that case (``auto_plan.schedules_for_cores``);
* the **shape**: the planner's next best plans by simulated step (``extra["ranked"]``) and
  its data-parallel and straight-pipeline alternatives (``extra["alternatives"]``, DAPPLE
  Table 4's three kinds);
* **out-of-order backprop** on or off (``ooo="auto"``; ooo-backprop sec. 3);
* **M** halved and doubled (``micro_batches`` not given; DAPPLE 5.2's trade of bubble against
  per-micro-batch cost).

Each is finished as the run would finish it (``auto_plan.run_finisher``), priced by the
simulator as it would run (``schedule_choice.price_candidate``) and must fit the devices'
memory. Duplicates are dropped; ``count`` are kept, the simulator's own choice first, then
the best by simulated step of each other shape and schedule, then the best of the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.plan import CHUNKED_SCHEDULES, Plan, StagePlan, plan_from_dict
from lightning_dapple.plan.schedule_choice import RUNNABLE_SCHEDULES, Candidate, Pricing, price_candidate, schedule_candidates
from lightning_dapple.plan.schedule_table import DEFAULT_SCHEDULE
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.simulate.plan_and_schedule import make_plan, price_plan
from lightning_dapple.strategy.auto_plan import PlanningInputs, run_finisher, simulated_as_run
from lightning_dapple.strategy.resolve import PlanArguments, resolve_plan

__all__ = ["DEFAULT_TUNE_CANDIDATES", "TuneCandidate", "candidate_label", "tuning_candidates"]

#: how many plans ``tune_steps`` measures unless told otherwise
DEFAULT_TUNE_CANDIDATES = 4


@dataclass(frozen=True)
class TuneCandidate:
    """A plan to measure, what to call it, and its simulated step."""

    plan: Plan
    label: str
    simulated_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "label": self.label, "simulated_ms": self.simulated_ms}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TuneCandidate":
        return cls(plan_from_dict(data["plan"]), str(data["label"]), float(data["simulated_ms"]))


def candidate_label(plan: Plan) -> str:
    """'2:2 (layers 5:7) M=4 dapple PB, ooo': shape, layer cut, M, schedule, K_i policy and
    out-of-order backprop, what tells two candidates apart."""
    split = ":".join(str(stage.end - stage.start) for stage in plan.stages)
    return f"{plan.kind()} (layers {split}) M={plan.micro_batches} {plan.schedule} {plan.policy}{', ooo' if plan.ooo else ''}"


def tuning_candidates(
    chosen: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    arguments: PlanArguments,
    count: int = DEFAULT_TUNE_CANDIDATES,
    communicator_bytes: float = 0.0,
) -> list[TuneCandidate]:
    """The plans to measure (module docstring): ``chosen`` (the plan the run would execute
    untuned, its ``predicted`` step the simulator's) first, then up to ``count - 1`` rivals
    by simulated step."""
    require(isinstance(count, int) and count >= 1, "tune_candidates", f"is {count!r}", "use a positive integer (how many plans to measure)")
    pricing = Pricing(profile, cluster, price_plan, run_finisher(arguments, profile, cluster), communicator_bytes)
    first = TuneCandidate(chosen, candidate_label(chosen), _simulated_ms(chosen, profile, cluster))
    seen = {_identity(chosen)}
    rivals: list[TuneCandidate] = []
    for candidate in _rivals(chosen, profile, cluster, arguments, pricing):
        if not candidate.fits or candidate.plan is None:
            continue
        plan = simulated_as_run(resolve_plan(candidate.plan, arguments), PlanningInputs(profile, cluster))  # priced as it would run
        key = _identity(plan)
        if key in seen:
            continue
        seen.add(key)
        label = candidate_label(plan)
        taken = {first.label, *(each.label for each in rivals)}
        label = next(f"{label} #{n}" for n in range(2, len(taken) + 3) if f"{label} #{n}" not in taken) if label in taken else label
        rivals.append(TuneCandidate(plan, label, _simulated_ms(plan, profile, cluster)))
    rivals.sort(key=lambda each: each.simulated_ms)
    return [first, *_diverse(first, rivals, count - 1)]


def _diverse(first: TuneCandidate, rivals: list[TuneCandidate], count: int) -> list[TuneCandidate]:
    """``count`` of ``rivals`` (sorted by simulated step): first the best of each shape and
    schedule not yet taken, then the best of the rest. The simulator's errors are mostly
    structural (a shape or schedule it prices too well or too badly), so trials of other
    shapes and schedules are the ones most likely to overturn its choice."""
    signature = lambda each: (each.plan.kind(), each.plan.schedule, each.plan.ooo)  # noqa: E731
    taken, seen = [], {signature(first)}
    for each in rivals:
        if len(taken) < count and signature(each) not in seen:
            taken.append(each)
            seen.add(signature(each))
    taken += [each for each in rivals if each not in taken][: count - len(taken)]
    return sorted(taken, key=lambda each: each.simulated_ms)


def _simulated_ms(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    if plan.predicted is not None and plan.predicted.simulated_latency_ms is not None:
        return float(plan.predicted.simulated_latency_ms)
    simulation, _, _ = price_plan(plan, profile, cluster)
    return float(simulation.latency_ms)


def _identity(plan: Plan) -> str:
    """What makes two candidates the same run: the plan less its prediction, reason and notes."""
    data = plan.with_warmups().to_dict()
    for key in ("predicted", "reason", "extra", "planner"):
        data.pop(key, None)
    return repr(sorted(data.items()))


def _rivals(chosen: Plan, profile: ModelProfile, cluster: Cluster, arguments: PlanArguments, pricing: Pricing) -> Iterator[Candidate]:
    """Every plan one axis away from ``chosen`` that the user left open, priced."""
    base = _one_stage_per_group(chosen, profile, cluster, arguments, pricing)
    if arguments.fixed_schedule is None and base is not None:
        yield from schedule_candidates(base, profile, cluster, price_plan, RUNNABLE_SCHEDULES, pricing.finish)
    for alternative in _shape_alternatives(base or chosen, profile.num_layers):
        yield from _under_named_schedule(alternative, arguments.fixed_schedule, profile, cluster, pricing)
    if arguments.ooo == "auto" and chosen.num_stages > 1 and chosen.chunks == 1:
        flipped = replace(arguments, ooo=not chosen.ooo)
        yield price_candidate(Candidate(chosen.schedule, 1, False, _unfinished(chosen)), replace(pricing, finish=run_finisher(flipped, profile, cluster)))
    if arguments.micro_batches is None:
        for micro_batches in (chosen.micro_batches // 2, chosen.micro_batches * 2):
            if micro_batches < 1 or chosen.global_batch_size % micro_batches:
                continue
            resized = replace(_unfinished(chosen), micro_batches=micro_batches)
            try:
                resized.validate()
            except DappleConfigError:
                continue
            yield price_candidate(Candidate(chosen.schedule, chosen.chunks, False, resized), pricing)


def _under_named_schedule(alternative: Plan, named: str | None, profile: ModelProfile, cluster: Cluster, pricing: Pricing) -> Iterator[Candidate]:
    """``alternative`` (one stage per device group, DAPPLE's schedule) priced under the
    schedule the user named: as it is when none was named, rescheduled for a named 1F1B or
    GPipe, and cut into chunks for a named chunked schedule, which a plan of one device group
    (DP) cannot run and so does not offer. The schedule is not the tuner's to change."""
    if named is None:
        yield price_candidate(Candidate(alternative.schedule, 1, False, alternative), pricing)
    elif named not in CHUNKED_SCHEDULES:
        yield price_candidate(Candidate(named, 1, False, replace(alternative, schedule=named)), pricing)
    elif len(alternative.device_groups) > 1:
        yield from schedule_candidates(alternative, profile, cluster, price_plan, (named,), pricing.finish)


def _unfinished(plan: Plan) -> Plan:
    """``plan`` before the run's finishing choices: K_i, ooo and its caps left to be chosen again."""
    stages = tuple(replace(stage, warmup=None) for stage in plan.stages)
    return replace(plan, stages=stages, ooo=False, ooo_in_flight=None, predicted=None)


def _one_stage_per_group(chosen: Plan, profile: ModelProfile, cluster: Cluster, arguments: PlanArguments, pricing: Pricing) -> Plan | None:
    """The planner's plan under DAPPLE's schedule, which the schedule candidates start from:
    ``chosen`` itself unless it runs chunks, else the planner run again for the same devices
    and batch with the schedule fixed (its chunked plan cannot be cut back)."""
    if chosen.chunks == 1:
        return _unfinished(replace(chosen, schedule=DEFAULT_SCHEDULE))
    kwargs = {**arguments.planner_kwargs(), "schedule": DEFAULT_SCHEDULE}
    try:
        return make_plan(
            profile, cluster, chosen.global_batch_size, num_devices=chosen.world_size, finish=pricing.finish,
            communicator_bytes=pricing.communicator_bytes, **kwargs,
        )
    except DappleConfigError:
        return None


def _shape_alternatives(plan: Plan, num_layers: int) -> Iterator[Plan]:
    """The planner's next best plans (``extra["ranked"]``: M and stages) and the
    data-parallel and straight plans it priced beside its choice (``extra["alternatives"]``:
    kind, M and layer split), as plans."""
    for record in plan.extra.get("ranked") or []:
        try:
            stages = tuple(StagePlan(layers=tuple(stage["layers"]), devices=tuple(stage["devices"]), zero=int(stage.get("zero", 0))) for stage in record["stages"])
            yield Plan(plan.global_batch_size, int(record["micro_batches"]), stages, schedule=DEFAULT_SCHEDULE, policy=plan.policy, planner=plan.planner).validate(num_layers=num_layers)
        except (DappleConfigError, KeyError, TypeError, ValueError):
            continue
    for name, record in (plan.extra.get("alternatives") or {}).items():
        split = [int(each) for each in record.get("split", [])]
        if sum(split) != num_layers or not split:
            continue
        world = plan.world_size
        if name == "dp":
            stages = (StagePlan(layers=(0, num_layers), devices=tuple(range(world))),)
        elif name == "straight" and len(split) == world:
            bounds = [sum(split[:index]) for index in range(len(split) + 1)]
            stages = tuple(StagePlan(layers=(bounds[i], bounds[i + 1]), devices=(i,)) for i in range(len(split)))
        else:
            continue
        try:
            yield Plan(plan.global_batch_size, int(record["micro_batches"]), stages, schedule=DEFAULT_SCHEDULE, policy=plan.policy, planner=plan.planner).validate()
        except DappleConfigError:
            continue
