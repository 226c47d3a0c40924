"""Why this plan: the one-line reason a plan carries, from the numbers (DAPPLE 6.2 style).

DP is compared with the fastest pipeline of the planner's pool, a pipeline with DP and with
the straight pipeline; each comparison quotes the AllReduce the pipeline avoids and the
bubble it pays instead.
"""
from __future__ import annotations

from typing import Any, Sequence

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.evaluate import Scored, format_gib
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.units import format_bytes

__all__ = ["describe_choice", "pair_for", "summary"]


def pair_for(pool: list[Scored], simulations: dict[int, Any], wanted: list[Scored]) -> tuple[Scored, Any] | None:
    if not wanted:
        return None
    for index, item in enumerate(pool):
        if item.micro_batches == wanted[0].micro_batches and item.stages == wanted[0].stages:
            return item, simulations.get(index)
    return wanted[0], None


def summary(pair: tuple[Scored, Any]) -> dict[str, Any]:
    item, sim = pair
    out: dict[str, Any] = {
        "kind": item.kind(),
        "micro_batches": item.micro_batches,
        "latency_ms": item.latency_ms,
        "split": [stage.end - stage.start for stage in item.stages],
    }
    if sim is not None:
        out["simulated_latency_ms"] = float(sim.latency_ms)
    return out


def _latency(pair: tuple[Scored, Any] | tuple[Scored, None]) -> float:
    item, sim = pair
    return float(sim.latency_ms) if sim is not None else item.latency_ms


def _bubble_ms(item: Scored, sim: Any) -> float:
    """Idle time per device: simulated bubble share x latency, else the formula's L - M(F_Q+B_Q),
    B_Q with the pivot's gradient accumulations (M - 1 of them, ``StageCost.accumulate_ms``)."""
    if sim is not None:
        return float(sim.bubble_fraction) * float(sim.latency_ms)
    costs = item.costs
    q = item.prediction.pivot_stage
    m = item.micro_batches
    return item.latency_ms - m * (costs[q].forward_ms + costs[q].backward_ms) - (m - 1) * costs[q].accumulate_ms


def _split_text(stages: Sequence[StagePlan]) -> str:
    return ":".join(str(stage.end - stage.start) for stage in stages)


def describe_choice(
    chosen: Scored,
    sim: Any,
    cluster: Cluster,
    dp: tuple[Scored, Any] | None,
    straight: tuple[Scored, Any] | None,
    dp_all: Sequence[Scored] = (),
    runner_up: tuple[Scored, Any] | None = None,
) -> str:
    """One line saying why this plan, from the numbers (DAPPLE 6.2 style): DP is compared
    with the fastest pipeline of the planner's pool (``runner_up``: simulated, or by formula
    without simulations; the pool holds the search's pipelines, the straight one and their
    balanced twins, see ``dapple_planner``), a pipeline with DP and the straight pipeline."""
    kind = chosen.kind()
    latency = _latency((chosen, sim))
    where = "simulated" if sim is not None else "formula"
    if kind == "single":
        return f"single device: nothing to split or replicate ({latency:.1f} ms per step, {where})"
    if kind == "DP":
        ar = chosen.costs[0].allreduce_ms
        params = chosen.costs[0].param_bytes
        bw = cluster.ring_bandwidth_gbps(chosen.stages[0].devices)
        text = f"DP: AllReduce of {format_bytes(params, paper=True)} over {bw:g} Gbit/s costs {ar:.1f} ms"
        if runner_up is not None:
            other, other_sim = runner_up
            label = "straight" if other.kind() == "straight" else other.kind()
            which = "fastest pipeline simulated" if other_sim is not None else "best pipeline by formula"
            text += (
                f", less than the bubble of the {which} ({label}, {_bubble_ms(other, other_sim):.1f} ms): "
                f"{latency:.1f} vs {_latency(runner_up):.1f} ms per step ({where})"
            )
        else:
            text += f" ({latency:.1f} ms per step, {where}); no valid pipeline fits"
        return text
    label = "straight pipeline" if kind == "straight" else f"{kind} pipeline"
    text = f"{label} (layers {_split_text(chosen.stages)}, M={chosen.micro_batches})"
    if dp is not None:
        dp_item, dp_sim = dp
        ar = dp_item.costs[0].allreduce_ms
        bw = cluster.ring_bandwidth_gbps(dp_item.stages[0].devices)
        text += (
            f": AllReduce of {format_bytes(dp_item.costs[0].param_bytes, paper=True)} over {bw:g} Gbit/s would cost {ar:.1f} ms under DP "
            f"({_latency(dp):.1f} ms per step), the pipeline's bubble costs {_bubble_ms(chosen, sim):.1f} ms ({latency:.1f} ms per step, {where})"
        )
    elif dp_all:
        need = min(item.peak_memory_bytes for item in dp_all)  # at its least hungry M (and ZeRO level, where the planner may shard)
        text += f": DP needs {format_gib(need)} per device, more than {cluster.device_memory_gib:g} GiB; this plan takes {latency:.1f} ms per step ({where})"
    else:
        text += f": DP is not valid here (slices would fall below the floor); {latency:.1f} ms per step ({where})"
    if straight is not None and kind != "straight":
        text += f"; straight: {_latency(straight):.1f} ms"
    return text
