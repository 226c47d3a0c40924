"""``plan="auto"``: profile the layers on a real micro-batch and run the bundled planner.

Rank 0 profiles the whole layer list once (layer by layer, lightning_dapple.profile) on
a slice of the first training batch, plans for the real world size and global batch
(DAPPLE 4), chooses the schedule by simulation unless the user named one
(``plan.schedule_choice``, among ``RUNNABLE_SCHEDULES``), and broadcasts the plan so
every rank executes the same one. The cluster is
the one given to the strategy, or this machine as detected (``cluster.detect_cluster``:
the Trainer's nodes x devices per node, the GPUs' name and memory, else the host's
memory per CPU process) with its AllReduce's cost per call and bandwidth measured on the
run's own processes (``execute/collective_probe.py``). The plan records the cluster it was made for in
``extra["cluster"]``, so the plan file names the memory it was fitted into.

Profiling runs layer by layer (only one layer on the device at a time) on one
micro-batch slice that stays where the module lives, under autocast when the Trainer
trains in mixed precision, so the times are those of the precision that will run. The
executor's own time per action is measured beside it (``execute/overhead_probe.py``), and
so is one step of the run's optimizer over each layer (``strategy/optimizer_probe.py``),
so the planner and the simulator that picks M and ``ooo="auto"`` price both, and so is the
user's step around the layers on the first and last stages (``strategy/glue_probe.py``).

A model built on the meta device (``meta_build.py``) has no layer to run until its stages
are made: rank 0 then makes one layer at a time, profiles it, and frees it before the next
(``meta_profile.py``), so no rank ever holds the whole model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dapple.cluster import Cluster, usable_cores
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.collective_probe import with_measured_links
from lightning_dapple.execute.overhead_probe import with_action_overhead
from lightning_dapple.execute.slicing import batch_size_of, take_rows
from lightning_dapple.plan.communicators import communicator_reserve_bytes
from lightning_dapple.atomic_files import atomic_write_text
from lightning_dapple.plan.plan import CHUNKED_SCHEDULES, Plan, PlanShape, load_plan, plan_from_dict
from lightning_dapple.plan.options import set_options
from lightning_dapple.plan.schedule_choice import RUNNABLE_SCHEDULES, Finisher
from lightning_dapple.plan.shape_plan import plan_shape
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.simulate.memory_fit import apply_ooo_recompute
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan
from lightning_dapple.strategy.glue_probe import with_step_glue
from lightning_dapple.strategy.meta_profile import profile_one_layer_at_a_time
from lightning_dapple.strategy.module_adapter import LogRecorder, capture_input
from lightning_dapple.strategy.ooo_choice import decide_ooo, with_ooo_choice
from lightning_dapple.strategy.optimizer_probe import with_run_optimizer
from lightning_dapple.strategy.resolve import PlanArguments

__all__ = ["AutoPlan", "PlanningContext", "PlanningInputs", "auto_plan", "run_communicator_reserve", "run_finisher", "simulated_as_run"]


@dataclass(frozen=True)
class PlanningContext:
    """What planning needs to know about the run, collected by the strategy on every rank."""

    arguments: PlanArguments
    cluster: Cluster
    device: torch.device
    world_size: int
    global_rank: int
    directory: Path
    resuming: bool
    profile_cache: str | None = None
    autocast_dtype: torch.dtype | None = None
    local_processes: int = 1
    # the cluster was detected, its links assumed: measure the run's AllReduce before planning
    measure_links: bool = False
    # the step the Trainer runs now, whose self(...) call gives the layers' input to profile
    step_name: str = "training_step"


def schedules_for_cores(device_type: str, local_processes: int, cores: int) -> tuple[tuple[str, ...], str]:
    """The schedules ``schedule="auto"`` may choose on this machine, and why some are left out.

    On devices of their own a rank waiting in a bubble is idle time the schedule should
    remove. CPU processes that outnumber the cores they share are different: a rank's bubble
    is another rank's compute, so interleaving and ZB-V, which shrink bubbles by running
    more actions (more transfers, chunk hand-offs, each a context switch between processes),
    only add CPU work there. The simulator bounds such steps by the machine's compute
    (``simulate.cores``) but not by the cost of switching; measured on 4 processes sharing 2
    cores, the interleaved plan it preferred for the quick start before that bound ran
    slower than its 1F1B plan (docs/schedules.md, "Schedules beyond 1F1B"). They stay candidates on GPUs
    and on CPUs with a core per rank.
    """
    if device_type != "cpu" or local_processes <= cores:
        return RUNNABLE_SCHEDULES, ""
    kept = tuple(name for name in RUNNABLE_SCHEDULES if name not in CHUNKED_SCHEDULES)
    return kept, (
        f"Interleaved and ZB-V were not tried: {local_processes} CPU processes share {cores} cores, "
        "so a rank's bubble is another rank's compute, and their extra actions only add work."
    )


@dataclass(frozen=True)
class PlanningInputs:
    """The measured profile and the cluster a plan was made for (rank 0 only)."""

    profile: ModelProfile
    cluster: Cluster


def simulated_as_run(plan: Plan, inputs: PlanningInputs) -> Plan:
    """``plan`` whose predicted simulated step and bubble are those of the plan as it runs:
    after the user's arguments (a recomputation mode, M, the schedule) and the out-of-order
    choice, on the cluster the run's report simulates it on (shared cores included). The
    planner simulated the plan it chose before those were applied, so its table and
    ``dapple_plan.json`` would otherwise name another step than ``result.json`` and the
    simulated timeline."""
    if plan.predicted is None:
        return plan
    result = simulate_plan(plan, inputs.profile, inputs.cluster)
    predicted = replace(plan.predicted, simulated_latency_ms=result.latency_ms, bubble_fraction=result.bubble_fraction)
    return replace(plan, predicted=predicted)


@dataclass(frozen=True)
class AutoPlan:
    plan: Plan
    inputs: PlanningInputs | None = None


def auto_plan(
    context: PlanningContext,
    module: LightningModule,
    container: nn.Module,
    sample: Any,
    shape: PlanShape | None = None,
    share: Callable[[Any], Any] | None = None,
    real: Callable[[nn.Module], ContextManager[Any]] | None = None,
) -> AutoPlan:
    """The run's plan: rank 0 profiles and plans, every rank receives the same plan. With
    ``shape`` (stages given by their devices) the planner only chooses the layer cut and,
    where the shape leaves it open, M (``plan.shape_plan``). ``share`` gives rank 0's
    result to every rank; the strategy's waits for as long as rank 0 lives
    (``execute/store_sync.py``), since profiling and planning may take longer than any
    transfer timeout; without one, a broadcast on the process group. ``real(layer)`` makes
    a layer of a model built on the meta device real for a while: each is then profiled
    alone, made and freed in turn (``meta_profile.py``)."""
    saved = context.directory / "dapple_plan.json"
    if context.resuming and saved.is_file():
        return AutoPlan(load_plan(saved))  # resuming reuses the plan of the run
    if context.measure_links:  # a collective: every rank takes part
        context = replace(context, cluster=with_measured_links(context.cluster, context.device))
    data: Any = None
    inputs: PlanningInputs | None = None
    if context.global_rank == 0:
        try:
            plan, inputs = _plan_on_rank_zero(context, module, container, sample, shape, real)
            data = plan.to_dict()
        except DappleConfigError as exc:  # shared with every rank so all stop with the same message
            data = {"__error__": [exc.field, exc.problem, exc.fix]}
        except Exception as exc:
            data = {"__error__": ["plan='auto'", f"planning failed on rank 0: {type(exc).__name__}: {exc}", "pass an explicit plan to bypass the planner"]}
    if share is not None:
        data = share(data)
    elif dist.is_initialized() and dist.get_world_size() > 1:
        holder = [data]
        dist.broadcast_object_list(holder, src=0)
        data = holder[0]
    if "__error__" in data:
        raise DappleConfigError(*data["__error__"])  # the planner's own what/problem/fix, once
    return AutoPlan(plan_from_dict(data), inputs)


def run_communicator_reserve(device: torch.device) -> float:
    """Device bytes each NCCL communicator of this run takes (``plan.communicators``; 0 off
    NCCL), as the planner and the tuning candidates price it."""
    return communicator_reserve_bytes(device.type, dist.get_backend() if dist.is_initialized() else None)


def run_finisher(arguments: PlanArguments, profile: ModelProfile, cluster: Cluster) -> Finisher:
    """What the run does to a planned plan before executing it: a recomputation mode the
    user fixed for every stage (``recompute="always"``), out-of-order backprop on or off
    (``ooo_choice.decide_ooo``) and, with ``recompute="auto"``, the memory options
    (``simulate.memory_fit``). The planner, ``schedule="auto"`` and the tuning candidates
    apply it to every plan they price, so each is compared, and its step reported, as it
    would run."""

    def finish(plan: Plan) -> Plan:
        if isinstance(arguments.recompute, str) and arguments.recompute != "auto":
            plan = set_options(plan, recompute=arguments.recompute)
        modes = arguments.recompute if arguments.recompute is not None else [stage.recompute for stage in plan.stages]
        on, why = decide_ooo(arguments.ooo, plan, profile, cluster, recompute=modes)
        if arguments.recompute == "auto":
            plan = apply_ooo_recompute(plan, profile, cluster, ooo=on, recompute="auto")
        return with_ooo_choice(plan, on, why)

    return finish


def _profile(context: PlanningContext, module: LightningModule, container: nn.Module, x: Any, real: Callable[[nn.Module], ContextManager[Any]] | None) -> ModelProfile:
    """Each layer's profile with the run's optimizer step, for the planner and simulator."""
    options = {"device": context.device, "cache_dir": context.profile_cache, "name": type(module).__name__, "autocast_dtype": context.autocast_dtype}
    if real is not None:  # built on the meta device: one layer real at a time
        profile = profile_one_layer_at_a_time(list(container), x, real, module, **options)
    else:
        profile = profile_layers(container, x, **options)
        profile = with_run_optimizer(profile, module, list(container), context.device)  # each stage's optimizer step
    return with_action_overhead(profile, context.device)  # priced by the simulator that picks M and ooo


def _plan_on_rank_zero(
    context: PlanningContext, module: LightningModule, container: nn.Module, sample: Any, shape: PlanShape | None, real: Callable[[nn.Module], ContextManager[Any]] | None
) -> tuple[Plan, PlanningInputs]:
    rows = batch_size_of(sample)
    per_device = max(1, rows // max(1, context.world_size))
    piece = take_rows(sample, 0, per_device)
    with LogRecorder().recording(module, 0.0):
        x = capture_input(module, lambda: getattr(module, context.step_name)(piece, 0))
    profile = _profile(context, module, container, x, real)
    if real is None and context.step_name == "training_step":  # a meta-built model has no whole forward to answer self(...) with
        profile = with_step_glue(profile, module, container, piece, x, context.device, context.autocast_dtype)
    cluster, arguments = context.cluster, context.arguments
    finish = run_finisher(arguments, profile, cluster)
    if shape is None:
        named = arguments.fixed_schedule is not None
        schedules, left_out = (RUNNABLE_SCHEDULES, "") if named else schedules_for_cores(context.device.type, context.local_processes, usable_cores())
        reserve = run_communicator_reserve(context.device)
        plan = make_plan(profile, cluster, rows, num_devices=context.world_size, schedules=schedules, finish=finish, communicator_bytes=reserve, **arguments.planner_kwargs())
        if left_out:
            plan = replace(plan, reason=f"{plan.reason.rstrip()} {left_out}")
    else:
        plan = finish(plan_shape(profile, cluster, shape, simulate=simulate_plan))
    plan = replace(plan, extra={**plan.extra, "cluster": cluster.to_dict()})
    atomic_write_text(context.directory / "dapple_profile.json", profile.to_json() + "\n")
    return plan, PlanningInputs(profile, cluster)
