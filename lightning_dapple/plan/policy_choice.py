"""Which K_i policy a plan runs with, when the user leaves it to the planner (DAPPLE 5.3).

DAPPLE's warm-up policies differ in how many forwards a stage runs before its first
backward: P_A, K_i = min(S - i, D), holds few micro-batches; P_B, K_i = min(2(S - i) - 1,
D), about twice as many, D being how many micro-batches the stage's memory holds. The
paper picks by the activation communication ratio: P_A "works well when ACR is small", P_B
when "the cross stage communication overhead is comparable with forward/backward
computations and thus more micro-batches is needed to saturate the pipeline" (5.3; Table 3:
P_B is 1.0x to 1.31x P_A). The simulator measures exactly that (P_A's K_i counts
computation stages, while a micro-batch's round trip also crosses the links;
benchmarks/README.md, bench_fidelity.py), so with policy "auto" each plan the planner
re-ranks is simulated under both policies and runs with the faster one, P_A on a tie.

The search sizes memory with P_A's K_i, so every plan it offers fits with them; P_B's K_i
are capped by each stage's D (``evaluate.in_flight_limits``) and never fall below P_A's, so
P_B fits wherever P_A does. Its counts are written into the plan's stages.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_dapple.plan.costs import step_lower_bound
from lightning_dapple.plan.evaluate import Scored, in_flight_limits
from lightning_dapple.plan.plan import Plan
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.plan.warmup import warmup_counts

__all__ = ["POLICIES", "PolicyChoice", "rescored", "simulate_policies"]

POLICIES = ("PA", "PB")


@dataclass(frozen=True)
class PolicyChoice:
    """The policy a plan runs with, its K_i and simulation, and the simulated ms of every
    policy tried."""

    policy: str
    simulation: Any
    tried: dict[str, float]
    warmups: tuple[int, ...] = ()

    def note(self) -> str:
        """'K_i policy PB (DAPPLE 5.3): 836.2 vs 941.0 ms under PA' when P_B won, else ''."""
        others = [f"{ms:.1f} ms under {name}" for name, ms in self.tried.items() if name != self.policy]
        if self.policy == "PA" or not others:
            return ""
        return f"K_i policy {self.policy} (DAPPLE 5.3): {self.simulation.latency_ms:.1f} vs {', '.join(others)}"

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "warmups": list(self.warmups), "simulated_ms": dict(self.tried)}


def _policies(request: PlanRequest, item: Scored) -> tuple[str, ...]:
    """Policies worth simulating: both when asked for 'auto' and they can differ (early
    backward with two stages or more), else the request's."""
    if request.auto_policy and schedule_spec(request.schedule).early_backward and len(item.stages) > 1:
        return POLICIES
    return (request.policy,)


def _warmups(request: PlanRequest, item: Scored, policy: str) -> tuple[int, ...]:
    """K_i of ``item`` under ``policy``, P_B's capped by each stage's memory (D of 5.3)."""
    limits = in_flight_limits(item.costs, item.micro_batches, request.cluster) if policy != request.policy else None
    return tuple(warmup_counts(len(item.stages), item.micro_batches, policy, request.schedule, memory_limits=limits))


def simulate_policies(request: PlanRequest, item: Scored, beat: float = float("inf")) -> PolicyChoice:
    """Simulate ``item`` (``request.simulate``) under each policy it may run with and keep
    the fastest, with the K_i of ``_warmups``. A policy whose K_i equal those of one
    already tried is not simulated again, and none beyond the request's own when no
    schedule of the plan can step faster than ``beat`` (``costs.step_lower_bound``: the
    plan cannot be chosen over the one that took ``beat``)."""
    assert request.simulate is not None
    best: tuple[str, Any, tuple[int, ...]] | None = None
    tried: dict[str, float] = {}
    seen: set[tuple[int, ...]] = set()
    hopeless = step_lower_bound(item.costs, item.micro_batches) > beat
    for policy in _policies(request, item):
        warmups = _warmups(request, item, policy)
        if warmups in seen or (seen and hopeless):
            continue
        seen.add(warmups)
        stages = tuple(replace(stage, warmup=count) for stage, count in zip(item.stages, warmups))
        bare = Plan(request.global_batch_size, item.micro_batches, stages, schedule=request.schedule, policy=policy)
        simulation = request.simulate(bare, request.profile, request.cluster)
        tried[policy] = float(simulation.latency_ms)
        if best is None or simulation.latency_ms < best[1].latency_ms:
            best = (policy, simulation, warmups)
    assert best is not None
    return PolicyChoice(best[0], best[1], tried, best[2])


def rescored(request: PlanRequest, item: Scored, choice: "PolicyChoice | None") -> Scored:
    """``item`` priced with the K_i it runs with (its per-stage memory), when the choice
    differs from the policy it was searched with."""
    if choice is None or choice.policy == request.policy:
        return item
    stages = tuple(replace(stage, warmup=count) for stage, count in zip(item.stages, choice.warmups))
    return request.score(stages, item.micro_batches, choice.policy)
