"""``DappleStrategy(tune_steps=N)``: keep the fastest measured of the simulator's best few plans.

``plan="auto"`` ranks plans by simulating them; where the simulator is off, its first plan
can run slower than its second. With ``tune_steps`` the strategy runs the best few
(``tune_candidates.py``: the simulator's choice and its rivals along schedule, shape,
out-of-order backprop and M) for N steps each on the real processes, and keeps the fastest
measured, as DeepSpeed's Autotuner keeps the fastest of its short trial runs. A rival
replaces the simulator's choice only when it measures faster by more than ``MIN_TUNE_GAIN``
or the choice's own step-to-step noise (the median absolute deviation of its timed steps
over their median): a difference the trials cannot tell from noise keeps the simulator's
plan.

**What a trial is.** Each candidate gets its own process groups and executor over this
rank's layers of that plan, and runs ``WARMUP_STEPS + N`` training steps on the first
training batch: the schedule (forward, backward, gradient sync: the executor's
``train_step``) and a step of a fresh copy of the run's optimizer (class and settings from
``configure_optimizers``, ``strategy/optimizer_probe.py``) over the rank's parameters. The
first ones are not timed. A candidate's measured step is the median over its timed steps of
the slowest rank. Where
no such copy can be made (several optimizers, manual optimization), the trial steps none
and adds the profiled optimizer step of the rank's layers (``LayerProfile.optimizer_ms``).
Under ZeRO the trial steps the whole stage on each replica, a little more than the run.

**Exact.** Training afterwards is the training the kept plan gives without tuning, bit for
bit: the parameters a trial steps and every layer's buffers (BatchNorm's running
statistics) are copied before it and put back after it, and so are the gradients; the
trial's optimizer (and its state) is dropped;
the executor reseeds every forward from the job's seed and the step number and restores
the caller's random stream after each step (``execute/runner.py``), and the run's own
executor starts again at step 0; the user's ``self.log`` calls in trials are recorded and
dropped, and the torchmetrics metrics its step updates get their states back; the trials'
process groups (the NCCL wire's link groups too) are destroyed and their gradient hooks and
out-of-order ``forward`` routes removed. A candidate the run would refuse afterwards
(``_runnable``) is not tried. What a ``training_step`` changes outside tensors and metrics
(a counter of its own) would see the trial steps; the docs say so. Under fp16's loss
scaling the trials step no optimizer (their gradients are scaled) and add the profiled step.

**Cached.** The outcome is kept beside the profile cache (``DappleStrategy(profile_cache=)``,
else ``$XDG_CACHE_HOME/lightning_dapple``), under a key of the model as the profiler sees it
(``profile.profiler.model_key``: layers, shapes, the batch's structure and rows), the
cluster, the world size, the user's plan arguments and the tuning settings. A second run
with the same model, cluster and batch reads the kept plan and does not tune again.

Trials need every rank to hold the whole model while they run (each plan puts other
layers on a rank), so a model built on the meta device is refused with tuning.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from rich.table import Table
from torch import nn

from lightning_dapple.atomic_files import atomic_write_text
from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.random_layers import draws_random
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.slicing import batch_size_of
from lightning_dapple.execute.tied import tied_groups
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.profiler import model_key
from lightning_dapple.profile.ties import tied_parameters
from lightning_dapple.strategy.auto_plan import PlanningInputs, run_communicator_reserve
from lightning_dapple.strategy.metric_state import MetricStates
from lightning_dapple.strategy.layer_rows import check_regrouped_cuts
from lightning_dapple.strategy.setup_checks import check_callbacks
from lightning_dapple.strategy.meta_build import built_on_meta
from lightning_dapple.strategy.module_adapter import LogRecorder
from lightning_dapple.strategy.optimizer_probe import optimizer_factory
from lightning_dapple.profile.optimizer_step import OptimizerFactory
from lightning_dapple.strategy.slice_transfer import StepTransfers
from lightning_dapple.strategy.step_callbacks import TrainCallbacks
from lightning_dapple.strategy.tune_candidates import TuneCandidate, tuning_candidates

__all__ = ["MIN_TUNE_GAIN", "WARMUP_STEPS", "PlanTuning", "check_tune_settings", "default_tuning_cache", "measured_choice"]

#: a rival must measure faster than the simulator's choice by more than this share (or the
#: choice's own step-to-step noise, if larger) to replace it
MIN_TUNE_GAIN = 0.03
#: untimed steps before each candidate's timed ones: its first steps pay for first use (the
#: new process groups' connections, allocations, lazily built caches)
WARMUP_STEPS = 2


def check_tune_settings(tune_steps: Any, tune_candidates: Any, plan: Any) -> None:
    """Refuse bad tuning arguments when the strategy is made, before any process starts."""
    for name, value, least in (("tune_steps", tune_steps, 0), ("tune_candidates", tune_candidates, 1)):
        require(
            isinstance(value, int) and not isinstance(value, bool) and value >= least,
            name,
            f"is {value!r}",
            "use 0 (no tuning) or the number of measured steps per candidate plan, e.g. 3" if name == "tune_steps" else "use how many plans to measure, e.g. 3",
        )
    require(
        not tune_steps or (isinstance(plan, str) and plan == "auto"),
        "tune_steps",
        f"is {tune_steps} but the plan is given ({type(plan).__name__}); tuning measures the planner's candidates",
        "use plan='auto' with tune_steps, or leave tune_steps at 0 to run the given plan",
    )


def default_tuning_cache() -> Path:
    """Where measured choices are kept without a ``profile_cache``: the user's cache directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_dapple"


def measured_choice(candidates: Sequence[TuneCandidate], measured_ms: Sequence[float], noise: float = 0.0) -> dict[str, Any]:
    """The record of a tuning: every candidate's simulated and measured step, the kept one and
    the simulator's. The kept one is the fastest measured, unless it beats the simulator's
    choice by no more than ``MIN_TUNE_GAIN`` or ``noise`` (the relative noise of the
    simulator's choice's own timed steps): a difference the trials cannot tell from their
    noise keeps the plan the simulator ranked first."""
    fastest = min(range(len(candidates)), key=lambda index: (measured_ms[index], index))
    margin = max(MIN_TUNE_GAIN, noise)
    kept = fastest if measured_ms[fastest] < measured_ms[0] * (1.0 - margin) else 0
    return {
        "chosen": candidates[kept].label,
        "chosen_index": kept,
        "simulator_choice": candidates[0].label,
        "margin": round(margin, 4),
        "candidates": [
            {"label": each.label, "simulated_ms": round(each.simulated_ms, 3), "measured_ms": round(ms, 3)} for each, ms in zip(candidates, measured_ms)
        ],
    }


def tuning_sentence(record: dict[str, Any]) -> str:
    """One sentence: what was kept, and whether the simulator ranked it first."""
    rows = {row["label"]: row for row in record["candidates"]}
    chosen, simulated = rows[record["chosen"]], rows[record["simulator_choice"]]
    source = " (kept from an earlier run's measurement)" if record.get("cached") else ""
    if record["chosen"] == record["simulator_choice"]:
        return (
            f"Tuning{source}: the simulator's choice {record['chosen']} was also the fastest measured "
            f"({chosen['measured_ms']:.2f} ms, {len(rows)} plans, {record['steps']} steps each)."
        )
    return (
        f"Tuning{source}: measured {record['chosen']} {chosen['measured_ms']:.2f} ms against {simulated['measured_ms']:.2f} ms for the "
        f"simulator's choice {record['simulator_choice']} (simulated {chosen['simulated_ms']:.2f} ms against {simulated['simulated_ms']:.2f} ms): "
        "the simulator ranks them the other way."
    )


def tuning_table(record: dict[str, Any]) -> Table:
    """Every plan tried, simulated against measured, the kept one and the simulator's marked:
    where the two columns rank the plans differently, the simulator was off for this run."""
    table = Table(title=f"tune_steps={record['steps']}: simulated against measured step")
    for column in ("plan", "simulated ms", "measured ms", "measured / simulated", ""):
        table.add_column(column)
    for row in record["candidates"]:
        ratio = row["measured_ms"] / row["simulated_ms"] if row["simulated_ms"] > 0 else float("nan")
        marks = [mark for mark, label in (("kept", record["chosen"]), ("simulator's", record["simulator_choice"])) if label == row["label"]]
        table.add_row(row["label"], f"{row['simulated_ms']:.2f}", f"{row['measured_ms']:.2f}", f"{ratio:.2f}", ", ".join(marks))
    return table


def _optimizer_ms_per_rank(plan: Plan, inputs: PlanningInputs) -> list[float]:
    """Each rank's profiled optimizer step under ``plan`` (``plan.costs.StageCost.optimizer_ms``)."""
    costs = stage_costs(inputs.profile, inputs.cluster, plan.stages, plan.micro_batch_size)
    return [sum(costs[stage].optimizer_ms for stage in plan.stages_of_rank(rank)) for rank in range(plan.world_size)]


def _spread(times: Sequence[float]) -> float:
    """The median absolute deviation of a candidate's timed steps over their median: their
    step-to-step noise, which one step slowed by another process does not set."""
    middle = statistics.median(times)
    return statistics.median(abs(each - middle) for each in times) / middle if len(times) > 1 and middle > 0 else 0.0


def _cluster_identity(cluster: Cluster) -> dict[str, Any]:
    """The cluster as the tuning cache tells runs apart: its devices and their memory, not the
    link costs measured afresh by each run on a detected machine (``collective_probe.py``)."""
    return {
        "name": cluster.name, "machines": cluster.machines, "devices_per_machine": cluster.devices_per_machine,
        "device_memory_gib": round(cluster.device_memory_gib, 1), "shared_cores": cluster.shared_cores,
    }


class _LayerState:
    """What a trial changes in some layers, to be put back after it: their buffers (by owner
    and name, so that one a layer reassigns is put back too), gradients, the instance
    ``forward`` an out-of-order stage routes through its store (``execute/weight_grad.py``),
    and the values of the parameters a trial optimizer steps (copied)."""

    def __init__(self, layers: Sequence[nn.Module], stepped: bool) -> None:
        modules = list({id(m): m for layer in layers for m in layer.modules()}.values())
        params = {id(p): p for layer in layers for p in layer.parameters()}
        self.trained = [p for p in params.values() if p.requires_grad]
        self.grads = [(p, p.grad) for p in params.values()]
        self.buffers = [(m, name, b, b.detach().clone()) for m in modules for name, b in m._buffers.items() if b is not None]
        self.forwards = [(m, m.__dict__.get("forward")) for m in modules]
        self.values = [(p, p.detach().clone()) for p in self.trained] if stepped else []

    def restore(self) -> None:
        with torch.no_grad():
            for module, name, buffer, saved in self.buffers:
                module._buffers[name] = buffer
                buffer.copy_(saved)
            for param, saved in self.values:
                param.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad
        for module, forward in self.forwards:
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _link_groups(runner: Any) -> list[Any]:
    """The process groups a runner's wire made for its links (the NCCL wire: one per link and
    direction, ``execute/transfer/wires.py``); none for wires that use the default group."""
    wire = getattr(getattr(runner, "transport", None), "wire", None)
    groups = getattr(wire, "groups", None)
    return list(groups.values()) if isinstance(groups, dict) else []


def _destroy(groups: Sequence[Any]) -> None:
    """Destroy a trial's process groups on this rank (a local call: a group this rank is not
    in is ``NON_GROUP_MEMBER``, which ``destroy_process_group`` passes over)."""
    seen: set[int] = set()
    for group in groups:
        if group is None or id(group) in seen:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


class PlanTuning:
    """Part of :class:`~lightning_dapple.strategy.dapple_strategy.DappleStrategy` (module docstring);
    its methods read the strategy's state, set up in ``DappleStrategy.__init__``."""

    def _tuned_plan(self, trainer: Trainer, module: LightningModule, container: nn.Module, sample: Any, plan: Plan) -> Plan:
        """``plan`` (the simulator's choice, on every rank), or the fastest measured of the
        simulator's best few (module docstring)."""
        require(
            not built_on_meta(module),
            "tune_steps",
            "needs every rank to hold the whole model while it measures plans, but this model is built on the meta device",
            "leave tune_steps at 0 for a model built on the meta device, or build it whole",
        )
        inputs: PlanningInputs | None = self._planning_inputs
        payload: Any = None
        if self.global_rank == 0:
            try:
                payload = self._tuning_payload(trainer, module, container, sample, plan, inputs)
            except DappleConfigError as exc:  # shared, so that every rank stops with the same message
                payload = {"__error__": [exc.field, exc.problem, exc.fix]}
            except Exception as exc:
                payload = {"__error__": ["tune_steps", f"choosing the plans to measure failed on rank 0: {type(exc).__name__}: {exc}", "leave tune_steps at 0 to run the simulator's plan"]}
        payload = self._share_from_rank_zero(payload)
        if "__error__" in payload:
            raise DappleConfigError(*payload["__error__"])
        if "skip" in payload:
            return plan
        if "cached" in payload:
            record = payload["cached"]
            chosen = TuneCandidate.from_dict(record["kept"]).plan
            return self._with_record(chosen, {key: value for key, value in record.items() if key != "kept"} | {"cached": True})
        candidates = [TuneCandidate.from_dict(each) for each in payload["candidates"]]
        seed = self._sync.broadcast(torch.initial_seed(), "the job's seed") if self.world_size > 1 else torch.initial_seed()
        optimizer = self._trial_optimizer(module)
        metrics = MetricStates(module)
        try:
            steps = [self._trial(module, container, sample, each.plan, seed, optimizer) for each in candidates]
        finally:
            metrics.restore()
        per_rank = self._sync.gather(steps, "the tuning trials' step times") if self.world_size > 1 else [steps]
        result: Any = None
        if self.global_rank == 0:
            try:
                result = self._measured_record(candidates, per_rank, optimizer is not None, inputs)
                self._keep_tuning(payload["cache_file"], payload["key"], result, candidates[result["chosen_index"]])
            except Exception as exc:  # shared, so that every rank stops with the same message
                result = {"__error__": ["tune_steps", f"comparing the trials failed on rank 0: {type(exc).__name__}: {exc}", "leave tune_steps at 0 to run the simulator's plan"]}
        result = self._share_from_rank_zero(result)
        if "__error__" in result:
            raise DappleConfigError(*result["__error__"])
        return self._with_record(candidates[result["chosen_index"]].plan, result)

    def _trial_optimizer(self, module: LightningModule) -> OptimizerFactory | None:
        """A factory of fresh copies of the run's optimizer for the trials, or None: where none
        can be made, and under fp16's loss scaling (a trial would step on scaled gradients),
        the trials step none and the profiled optimizer step is added instead."""
        mixed = self._mixed()
        if mixed is not None and getattr(mixed, "scaler", None) is not None:
            return None
        make, _ = optimizer_factory(module)  # every rank alike: the same module's configure_optimizers
        return make

    def _measured_record(self, candidates: list[TuneCandidate], per_rank: list[Any], stepped: bool, inputs: PlanningInputs | None) -> dict[str, Any]:
        """Rank 0: each candidate's measured step from every rank's trial times, and the choice."""
        assert inputs is not None
        slowest = []  # per candidate, per timed step: the slowest rank (its optimizer step added where only profiled)
        for index, each in enumerate(candidates):
            profiled = [0.0] * self.world_size if stepped else _optimizer_ms_per_rank(each.plan, inputs)
            slowest.append([max(times[index][step] + profiled[rank] for rank, times in enumerate(per_rank)) for step in range(self.tune_steps)])
        measured = [statistics.median(steps_ms) for steps_ms in slowest]
        noise = _spread(slowest[0])  # the simulator's choice, step to step
        record = {"steps": self.tune_steps, "cached": False, "optimizer": "stepped" if stepped else "profiled"}
        result = measured_choice(candidates, measured, noise) | record
        if result["chosen_index"] != 0:  # what the untuned run would execute, to compare with
            result["simulator_plan"] = candidates[0].plan.to_dict()
        return result

    def _tuning_payload(self, trainer: Trainer, module: LightningModule, container: nn.Module, sample: Any, plan: Plan, inputs: PlanningInputs | None) -> dict[str, Any]:
        """Rank 0: what every rank does next: nothing (no planner ran), read the cache, or
        measure these candidates."""
        if inputs is None:  # the plan came from an earlier run's directory (a resumed fit)
            return {"skip": True}
        settings = {
            "model": model_key(list(container), sample, self.root_device, self.autocast_dtype()),
            "cluster": _cluster_identity(inputs.cluster),
            "world_size": self.world_size,
            "arguments": repr(self.plan_arguments),
            "tune_steps": self.tune_steps,
            "tune_candidates": self.tune_candidates,
            "wire": self.wire,
            "optimizer": optimizer_factory(module)[1],  # a trial's step is this optimizer's
        }
        key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
        directory = Path(self.profile_cache) if self.profile_cache is not None else default_tuning_cache()
        cache_file = directory / f"tuning-{key[:32]}.json"
        try:
            cached = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            cached = None
        if isinstance(cached, dict) and cached.get("key") == key and "kept" in cached:
            rank_zero_info(f"dapple: tune_steps: the plan measured fastest before is kept ({cache_file}; delete it to measure again)")
            return {"cached": cached}
        candidates = tuning_candidates(plan, inputs.profile, inputs.cluster, self.plan_arguments, self.tune_candidates, run_communicator_reserve(self.root_device))
        candidates = [candidates[0], *(each for each in candidates[1:] if self._runnable(trainer, each.plan))]
        rank_zero_info(f"dapple: tune_steps={self.tune_steps}: measuring {len(candidates)} plans: " + "; ".join(c.label for c in candidates))
        return {"candidates": [each.to_dict() for each in candidates], "key": key, "cache_file": str(cache_file)}

    def _runnable(self, trainer: Trainer, plan: Plan) -> bool:
        """Whether the run would accept ``plan`` after tuning: the checks set-up applies to the
        plan it runs (layer outputs that hold their rows elsewhere, callbacks that need one
        stage), so that no trial measures a plan the run would then refuse."""
        try:
            check_regrouped_cuts(plan, self._rows_elsewhere)
            check_callbacks(trainer, plan)
        except DappleConfigError:
            return False
        return True

    def _trial(self, module: LightningModule, container: nn.Module, sample: Any, plan: Plan, seed: int, optimizer: OptimizerFactory | None) -> list[float]:
        """This rank's ``tune_steps`` step times (ms) of ``plan``, after ``WARMUP_STEPS`` untimed;
        each step runs the schedule and, given a factory of the run's optimizer, its step."""
        assert self.failure is not None
        plan = plan.validate(num_layers=len(container), world_size=self.world_size).with_warmups()
        held = [index for stage in plan.stages_of_rank(self.global_rank) for index in range(plan.stages[stage].start, plan.stages[stage].end)]
        layers = [container[index] for index in held]
        state = _LayerState(layers, stepped=optimizer is not None)
        home = next((t.device for layer in layers for t in (*layer.parameters(), *layer.buffers())), self.root_device)
        ties = tied_parameters(container)
        groups = build_groups(plan)
        tie_groups = tied_groups(plan, ties) if ties else {}
        runner: Any = None
        try:
            for layer in layers:
                layer.to(self.root_device)
            runner = StageRunner.for_plan(
                plan, self.global_rank, layers, self.root_device, self.failure, groups=groups, ties=ties, tie_groups=tie_groups,
                loss_reduction="sum" if self.loss_reduction == "sum" else "mean", forward_context=self._forward_context(), wire=self.wire,
            )
            upstream = draws_random(container[index] for index in range(plan.stages[-1].start))
            for unit in getattr(runner, "units", [runner]):
                unit.pipeline_stage.upstream_draws = upstream and unit.is_last and not unit.is_first
            runner.job_seed = seed
            stepper = optimizer(state.trained) if optimizer is not None and state.trained else None
            times = self._timed_steps(runner, module, sample, plan, stepper)
            runner.finish()
        except BaseException as exc:
            self.failure.report(exc)
            raise
        finally:
            for unit in getattr(runner, "units", [runner]) if runner is not None else []:
                if getattr(unit, "sync", None) is not None:
                    unit.sync.close()  # its gradient hooks sit on the model's own parameters
            state.restore()
            for layer in layers:
                layer.to(home)
            if not self.failure.failed:
                _destroy([*groups.replicas.values(), groups.plan, *tie_groups.values(), *_link_groups(runner)])
        return times

    def _timed_steps(self, runner: Any, module: LightningModule, sample: Any, plan: Plan, stepper: torch.optim.Optimizer | None) -> list[float]:
        """Steps of ``runner`` on ``sample`` as ``training_step`` runs them (mixed precision's
        autocast and loss scale, the user's step with its logs recorded and dropped), each
        followed by ``stepper``'s step; the times of those after ``WARMUP_STEPS``."""
        mixed = self._mixed()
        context = mixed.forward_context if mixed is not None else nullcontext
        scale_backward = mixed.scale_backward if mixed is not None else None
        transfers = StepTransfers(self.root_device)
        rows, times = batch_size_of(sample), []
        for step in range(WARMUP_STEPS + self.tune_steps):
            recorder = LogRecorder()
            callbacks = TrainCallbacks(module, 0, recorder, transfers, rows, context, scale_backward, None, self._traced_inputs)
            _synchronize(self.root_device)
            start = time.perf_counter()
            with nullcontext() if mixed is not None else self.precision_plugin.train_step_context():
                runner.train_step(sample, callbacks, extras=lambda: recorder.summary(on_host=plan.world_size > 1))
            if stepper is not None:
                stepper.step()
            _synchronize(self.root_device)
            if step >= WARMUP_STEPS:
                times.append((time.perf_counter() - start) * 1e3)
        return times

    def _keep_tuning(self, cache_file: str, key: str, result: dict[str, Any], kept: TuneCandidate) -> None:
        """Rank 0: print the trials and keep the outcome for the next run (module docstring)."""
        console = make_console()
        console.print(tuning_table(result))
        console.print(tuning_sentence(result))
        try:
            atomic_write_text(Path(cache_file), json.dumps({**result, "key": key, "kept": kept.to_dict()}, indent=1) + "\n")
        except OSError as exc:  # the choice stands; only the next run measures again
            rank_zero_warn(f"dapple: tune_steps could not keep its choice in {cache_file} ({exc}); the next run measures again")

    def _with_record(self, plan: Plan, record: dict[str, Any]) -> Plan:
        """``plan`` carrying the tuning's record (``extra["tuning"]``) and sentence (``reason``)."""
        record = {key: value for key, value in record.items() if key not in ("key", "kept")}
        base = plan.reason.rstrip()
        sentence = tuning_sentence(record)
        reason = f"{base}{'' if not base or base.endswith('.') else '.'} {sentence}".strip()
        return replace(plan, reason=reason, extra={**plan.extra, "tuning": record})
