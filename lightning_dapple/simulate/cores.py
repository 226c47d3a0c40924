"""A step of CPU processes that share fewer cores than there are processes.

The simulator gives each device a clock of its own (DAPPLE's devices are GPUs): a stage
waiting in a bubble is time lost, and a schedule that fills bubbles with deferred weight
gradients (ooo-backprop sec. 3) or more, smaller chunks gains. Processes sharing cores
compute in turns instead: while one waits, the others run faster, and what decides the
step is the work the machine has to do. So on a machine whose ``cluster.shared_cores`` are
fewer than its devices, a step cannot end before that machine's compute (every F, B and W
of its devices, the executor's cost per action included, and their optimizer steps) has
run on its cores:

    step >= max over machines of (compute time of the machine's devices) / shared_cores

The simulated step is the later of the schedule's own end and this bound. Work that only
moves elsewhere, out of a bubble, then saves nothing, and work a schedule adds (the split
backward of ooo, measured in the profile as I + W against B) costs its share.
"""
from __future__ import annotations

from dataclasses import replace

from lightning_dapple.cluster import Cluster
from lightning_dapple.simulate.engine import COMPUTE_SPANS, SimulationResult

__all__ = ["shared_core_bound_ms", "bound_by_shared_cores"]

CORE_SPANS = (*COMPUTE_SPANS, "OPT")  # what takes a core: the pipeline's compute and the optimizer step


def shared_core_bound_ms(result: SimulationResult, cluster: Cluster) -> float | None:
    """The least step time the machines' shared cores allow ``result``'s compute, or None
    where every machine has a core per device (or the cluster does not share cores)."""
    cores = cluster.shared_cores
    if cores is None:
        return None
    work: dict[int, float] = {}
    devices: dict[int, int] = {}
    for device, spans in result.timelines.items():
        machine = cluster.machine_of(device)
        devices[machine] = devices.get(machine, 0) + 1
        work[machine] = work.get(machine, 0.0) + sum(span.end_ms - span.start_ms for span in spans if span.kind in CORE_SPANS)
    shared = [work[machine] / cores for machine in work if devices[machine] > cores]
    return max(shared) if shared else None


def bound_by_shared_cores(result: SimulationResult, cluster: Cluster) -> SimulationResult:
    """``result`` with its step no shorter than ``shared_core_bound_ms`` (its bubble fraction
    recomputed for the longer step), the bound recorded in ``core_bound_ms``."""
    bound = shared_core_bound_ms(result, cluster)
    if bound is None:
        return result
    latency = max(result.latency_ms, bound)
    busy = sum(stage.busy_ms * len(stage.devices) for stage in result.stages)
    devices = len(result.timelines)
    bubble = 1.0 - busy / (devices * latency) if latency > 0 and devices else result.bubble_fraction
    return replace(result, latency_ms=latency, bubble_fraction=bubble, core_bound_ms=bound)
