"""Which replicated stages shard their optimizer (ZeRO), when the planner is asked to choose.

DAPPLE's memory model (4.1, 5.3) keeps the whole optimizer state on every replica of a
stage; a plan whose state does not fit must then use fewer replicas and more stages, or
does not fit at all. Sharding the state over the replicas (ZeRO-1: each keeps the state of
about 1/d of the stage's parameters and steps only those, then broadcasts them to the
others, ``strategy/zero.py``) trades that memory for a parameter exchange after the step
(``costs.zero_exchange_ms``), and saves the other replicas' share of the optimizer step.

With ``zero="auto"`` the search runs once per level of ``request.zero_levels`` (every
replicated stage at that level, ``search.SearchSettings.zero``), so it finds the plans that
fit only with sharding as well as those that need none. ``refine_zero`` then gives each
replicated stage of a candidate its own level: the one under which the plan's formula-2
step (4.1) is shortest and every stage fits, so a stage whose state fits and whose exchange
costs more than its share of the step saves keeps its state whole. The re-ranking simulates
both kinds of candidate, and beside every sharded one its twin with every state whole
(``whole_twin``) where that fits, so sharding stays only where it simulates faster; ``zero_note`` says in the plan's reason where sharding made the
chosen plan fit or made it faster, and what the fastest plan without it would take.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from lightning_dapple.plan.evaluate import Scored, format_gib
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.request import PlanRequest

__all__ = ["level_of", "per_level", "refine_zero", "whole_twin", "zero_note", "zero_text"]

#: a formula-2 step shorter by less than this fraction is not worth a change of level
_GAIN = 1e-9


def level_of(stages: Sequence[StagePlan]) -> int:
    """The highest ZeRO level among ``stages`` (0: none shards)."""
    return max((stage.zero for stage in stages), default=0)


def per_level(items: Sequence[Scored], levels: Sequence[int], count: int) -> list[Scored]:
    """The first ``count`` of ``items`` (best first) of each ZeRO level, in their order: the
    re-ranking sees the best plans that need sharding, not only those that do not. A plan
    without replicas shards nothing at any level; it counts under the first."""
    taken: dict[int, int] = {}
    out = []
    for item in items:
        level = level_of(item.stages)
        level = level if level in levels else levels[0]
        if taken.get(level, 0) < count:
            taken[level] = taken.get(level, 0) + 1
            out.append(item)
    return out


def _with_levels(stages: Sequence[StagePlan], levels: Sequence[int]) -> tuple[StagePlan, ...]:
    return tuple(replace(stage, zero=level) for stage, level in zip(stages, levels))


def refine_zero(request: PlanRequest, item: Scored) -> Scored | None:
    """``item`` with each replicated stage at the level of ``request.zero_levels`` that gives
    the shortest formula-2 step with every stage within memory, stage by stage from the
    first (module docstring); None when that is ``item`` itself."""
    current = item
    for index, stage in enumerate(item.stages):
        if stage.replicas < 2:
            continue
        for level in request.zero_levels:
            if level == current.stages[index].zero:
                continue
            levels = [each.zero for each in current.stages]
            levels[index] = level
            other = _score(request, current, _with_levels(current.stages, levels))
            if other.fits(request.cluster) and (not current.fits(request.cluster) or other.latency_ms < current.latency_ms * (1 - _GAIN)):
                current = other
    return None if current.stages == item.stages else current


def whole_twin(request: PlanRequest, item: Scored) -> Scored | None:
    """``item`` with every stage's optimizer state whole, where it shards some and the twin
    fits: the re-ranking simulates both, so sharding is kept only where it is faster."""
    if level_of(item.stages) == 0:
        return None
    twin = _score(request, item, _with_levels(item.stages, [0] * len(item.stages)))
    return twin if twin.fits(request.cluster) else None


def _shape_key(item: Scored) -> tuple[int, tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """A plan's M and stages without their K_i and ZeRO levels."""
    return item.micro_batches, tuple((stage.start, stage.end, stage.devices) for stage in item.stages)


def _score(request: PlanRequest, item: Scored, stages: tuple[StagePlan, ...]) -> Scored:
    return request.score(stages, item.micro_batches)


def zero_text(stages: Sequence[StagePlan]) -> str:
    """'ZeRO-1 on stage 0 (1/4 of the optimizer state per replica)' for the sharded stages, '' if none."""
    sharded = [(index, stage) for index, stage in enumerate(stages) if stage.zero > 0]
    if not sharded:
        return ""
    levels = sorted({stage.zero for _, stage in sharded})
    names = "/".join(f"ZeRO-{level}" for level in levels)
    where = ", ".join(str(index) for index, _ in sharded)
    shares = ", ".join(sorted({f"1/{stage.replicas}" for _, stage in sharded}))
    return f"{names} on stage{'s' if len(sharded) > 1 else ''} {where} ({shares} of the optimizer state per replica)"


def zero_note(
    request: PlanRequest, chosen: Scored, sim: Any, pool: Sequence[Scored], simulations: dict[int, Any]
) -> tuple[str, dict[str, Any]]:
    """The reason's sentence on sharding and ``extra["zero_choice"]`` for the chosen plan:
    where its sharded stages would not fit whole (sharding made the plan fit) or step slower
    whole (sharding made it faster), and the fastest plan of the pool that shards nothing."""
    record: dict[str, Any] = {"levels": list(request.zero_levels), "stages": [stage.zero for stage in chosen.stages]}
    plain = [index for index, item in enumerate(pool) if level_of(item.stages) == 0]
    best_plain = min(plain, key=lambda i: _latency(pool[i], simulations.get(i)), default=None)
    if best_plain is not None:
        item = pool[best_plain]
        record["without_zero"] = {"kind": item.kind(), "micro_batches": item.micro_batches, "ms": _latency(item, simulations.get(best_plain))}
    text = zero_text(chosen.stages)
    if not text:
        return "", record
    budget = request.cluster.device_memory_bytes
    whole = _score(request, chosen, _with_levels(chosen.stages, [0] * len(chosen.stages)))
    record["memory_bytes"] = list(chosen.prediction.memory_bytes)
    record["memory_whole_bytes"] = list(whole.prediction.memory_bytes)
    ms = _latency(chosen, sim)
    where = "simulated" if sim is not None else "formula"
    if not whole.fits(request.cluster):
        text += (
            f" made the plan fit: {format_gib(chosen.peak_memory_bytes)} per device, {format_gib(whole.peak_memory_bytes)} "
            f"with every state whole (budget {format_gib(budget)})"
        )
    else:
        twins = [i for i, item in enumerate(pool) if level_of(item.stages) == 0 and _shape_key(item) == _shape_key(chosen)]
        whole_ms = _latency(pool[twins[0]], simulations.get(twins[0])) if twins else whole.latency_ms
        record["whole_ms"] = whole_ms
        text += f" made the plan faster: {ms:.1f} ms per step vs {whole_ms:.1f} ms with every state whole ({where})"
    if best_plain is not None:
        other = record["without_zero"]
        text += f"; the fastest plan without ZeRO is {other['kind']} (M={other['micro_batches']}), {other['ms']:.1f} ms"
    else:
        text += "; no plan without ZeRO fits"
    return text, record


def _latency(item: Scored, sim: Any) -> float:
    return float(sim.latency_ms) if sim is not None else item.latency_ms
