"""Lightning callbacks of ``dapple-train``: thread limit, step timer, plan report and timelines.

They run inside the worker processes (every rank runs every callback hook), so anything
that gathers across ranks (step times, peak stash, the measured timeline) does so in a
hook all ranks reach (``on_train_end``), and only rank 0 writes files, always into the
run directory given at construction, atomically (temp file + rename).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dapple.app.timelines import MeasuredTimeline, draw_measured_timeline
from lightning_dapple.atomic_files import atomic_write_text as write_text
from lightning_dapple.cluster import load_cluster
from lightning_dapple.plan import explain
from lightning_dapple.plan.console import make_console, render_text
from lightning_dapple.profile.model_profile import profile_from_dict
from lightning_dapple.simulate import draw_timeline, simulate_plan

__all__ = ["PipelineReport", "StepTimer", "WorkerSetup", "gather_to_zero", "quiet_warnings"]


# the timeline pictures each run directory gets (simulated plan, measured last step)
SIMULATED_TIMELINE = "timeline_simulated.png"
MEASURED_TIMELINE = "timeline_measured.png"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere). A collective: call on all ranks."""
    rank, world = _world()
    if world == 1:
        return [obj]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, obj)  # gloo and NCCL both support it
    return gathered if rank == 0 else None


# Warnings that say nothing to a dapple-train user: the run dir already holds Hydra's files;
# the strategy replays every rank's logs (no sync_dist needed); the data is generated in
# memory (no DataLoader workers needed).
QUIET_WARNINGS = (
    r".*Experiment logs directory .* exists and is not empty.*",
    r".*It is recommended to use `self\.log\(.*sync_dist=True.*",
    r".*does not have many workers.*",
    r".*isinstance\(treespec, LeafSpec\).*",
)


def quiet_warnings() -> None:
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


class WorkerSetup(Callback):
    """In every worker: ``torch.set_num_threads(threads)`` (the processes share the cores)
    and the app's warning filters (spawned workers do not inherit them)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        quiet_warnings()
        if self.threads > 0:
            torch.set_num_threads(self.threads)


class StepTimer(Callback):
    """Wall time of every training step and the peak stashed bytes, max over ranks.

    A step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (the whole
    pipelined schedule, gradient sync and optimizer step). At the end rank 0 writes
    ``step_times.json``: per step the slowest rank's time, the median over the steps
    after ``warmup_steps``, and the largest ``runner.stats.peak_stash_bytes`` any rank
    saw in any step. ``median_phase_ms`` splits the slowest rank's step at
    ``on_before_optimizer_step``: ``pipeline`` (the training step: the executor's schedule
    with its gradient sync, and Lightning's closure around it) and ``optimizer`` (the
    optimizer step and what Lightning does after it), medians after the warm-up, and
    ``executor``, the part of ``pipeline`` the executor's own step takes
    (``runner.stats.step_s``: what the simulator prices, with the user's step around the
    layers and the loss sharing); the rest of ``pipeline`` is Lightning's and the strategy's
    host work around it. ``peak_memory_bytes_per_rank`` is each rank's ``peak_memory`` at the end of the fit.
    """

    def __init__(self, run_dir: str, warmup_steps: int = 5) -> None:
        self.run_dir = run_dir
        self.warmup_steps = warmup_steps
        self.times_s: list[float] = []
        self.pipeline_s: list[float] = []
        self.executor_s: list[float] = []
        self.peak_stash_bytes = 0
        self._start: float | None = None
        self._optimizer_start: float | None = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        self._optimizer_start = None

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._start is not None and self._optimizer_start is None:  # the first optimizer of the step
            self._optimizer_start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._start is None:
            return
        end = time.perf_counter()
        self.times_s.append(end - self._start)
        self.pipeline_s.append((self._optimizer_start or end) - self._start)
        self._start = None
        runner = getattr(trainer.strategy, "runner", None)
        stats = getattr(runner, "stats", None)
        self.executor_s.append(float(getattr(stats, "step_s", 0.0)))
        if stats is not None:
            self.peak_stash_bytes = max(self.peak_stash_bytes, int(getattr(stats, "peak_stash_bytes", 0)))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        memory_bytes, memory_kind = peak_memory(trainer.strategy.root_device)
        gathered = gather_to_zero((self.times_s, self.peak_stash_bytes, self.pipeline_s, memory_bytes, self.executor_s))
        if gathered is None:
            return
        steps = min(len(times) for times, *_ in gathered)
        slowest = [max(gathered, key=lambda rank: rank[0][i]) for i in range(steps)]
        step_ms = [1e3 * rank[0][i] for i, rank in enumerate(slowest)]
        pipeline_ms = [1e3 * rank[2][i] for i, rank in enumerate(slowest)]
        executor_ms = [1e3 * rank[4][i] for i, rank in enumerate(slowest)]
        skip = min(self.warmup_steps, max(steps - 1, 0))
        kept = step_ms[skip:]
        summary = {
            "steps": steps,
            "warmup_steps": skip,
            "median_step_ms": statistics.median(kept) if kept else None,
            "mean_step_ms": statistics.fmean(kept) if kept else None,
            "step_ms": step_ms,
            "median_phase_ms": _phases(step_ms[skip:], pipeline_ms[skip:], executor_ms[skip:]),
            "peak_stash_bytes": max(rank[1] for rank in gathered),
            "peak_stash_bytes_per_rank": [rank[1] for rank in gathered],
            "peak_memory_bytes_per_rank": [rank[3] for rank in gathered],
            "peak_memory_kind": memory_kind,
            "ranks": len(gathered),
        }
        write_text(Path(self.run_dir) / "step_times.json", json.dumps(summary, indent=2) + "\n")


def peak_memory(device: torch.device) -> tuple[int, str]:
    """This process's peak memory so far, and what it counts. On a CUDA device, the most
    its tensors held there (``torch.cuda.max_memory_allocated``): the stage, its gradients
    and optimizer state, the stash, and whatever set-up (profiling, tuning trials) held.
    Elsewhere, the process's peak resident set (``ru_maxrss``), which also holds the Python
    runtime, torch's own allocations, and every layer the module built beside the stage."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "CUDA tensors (torch.cuda.max_memory_allocated)"
    import resource  # POSIX only; imported where the CPU path needs it

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process peak resident set (ru_maxrss)"


def _phases(step_ms: list[float], pipeline_ms: list[float], executor_ms: list[float]) -> dict[str, float] | None:
    """Medians of the slowest rank's ``pipeline`` part of a step, of the rest (``optimizer``)
    and of the executor's own step inside ``pipeline`` (``executor``)."""
    if not step_ms:
        return None
    return {
        "pipeline": statistics.median(pipeline_ms),
        "optimizer": statistics.median(step - pipeline for step, pipeline in zip(step_ms, pipeline_ms)),
        "executor": statistics.median(executor_ms),
    }


class PipelineReport(Callback):
    """The plan table, the simulated timeline and the measured timeline of a dapple run.

    * ``on_train_start`` (rank 0 only, no collective): for an explicit plan, print the plan
      table and write ``dapple_plan.txt`` and ``dapple_profile.json`` (plan="auto" runs get
      both from the strategy); simulate one step of the plan with the layer profile
      (``profile``, or the one plan="auto" measured) on ``cluster`` and draw
      ``timeline_simulated.png``.
    * ``on_train_end`` (all ranks): gather each rank's F/B/W spans of the last step
      (``strategy.runner.stats.timeline``) to rank 0, which writes
      ``timeline_measured.json`` and draws ``timeline_measured.png``.
    """

    def __init__(
        self,
        run_dir: str,
        cluster: dict[str, Any],
        profile: dict[str, Any] | None = None,
        profile_cache: str | None = None,
        table: bool = True,
        simulated: bool = True,
        measured: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.cluster = cluster
        self.profile = profile
        self.profile_cache = profile_cache
        self.table = table
        self.simulated = simulated
        self.measured = measured
        self.notes: list[str] = []

    # -- start: plan table and simulation (rank 0) ---------------------------------------
    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None or trainer.global_rank != 0:
            return
        run_dir = Path(self.run_dir)
        profile = self._load_profile(run_dir)
        if profile is not None and not (run_dir / "dapple_profile.json").is_file():
            write_text(run_dir / "dapple_profile.json", profile.to_json() + "\n")
        if self.table and not (run_dir / "dapple_plan.txt").is_file():
            # plan="auto" runs get the table from the strategy; explicit plans get it here
            self._write_table(plan, profile, run_dir)
        if self.simulated:
            try:
                self._simulate(plan, profile, run_dir)
            except Exception as exc:  # a picture must never stop training
                self._note(run_dir, f"simulated timeline not drawn: {type(exc).__name__}: {exc}")

    def _load_profile(self, run_dir: Path) -> Any:
        """The layer profile of this run: measured by the app for an explicit plan, or the
        one plan="auto" measured (``dapple_profile.json``, else the profile cache)."""
        if self.profile is not None:
            return profile_from_dict(self.profile)
        files = [run_dir / "dapple_profile.json"]
        if self.profile_cache:
            files += sorted(Path(self.profile_cache).glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for file in files:
            if file.is_file():
                try:
                    return profile_from_dict(json.loads(file.read_text()), source=file.name)
                except Exception:
                    continue
        return None

    def _cluster_of(self, plan: Any) -> dict[str, Any]:
        """The app's cluster, or the plan's record of it (``plan.extra["cluster"]``: with
        ``cluster=auto`` the same machine with its AllReduce measured at set-up) where the
        plan was made for a cluster of the same name and shape."""
        recorded = plan.extra.get("cluster")
        same = ("name", "machines", "devices_per_machine")
        if isinstance(recorded, dict) and all(recorded.get(key) == self.cluster.get(key) for key in same):
            return dict(recorded)
        return dict(self.cluster)

    def _write_table(self, plan: Any, profile: Any, run_dir: Path) -> None:
        """The project's plan table (lightning_dapple.plan.explain) when a profile is at hand,
        else the app's own; printed and written to ``dapple_plan.txt``."""
        parts: list[Any] = []
        if profile is not None:
            try:
                parts = _explained(plan, profile, self._cluster_of(plan))
            except Exception as exc:  # the table must never stop training
                self._note(run_dir, f"plan explanation not available: {type(exc).__name__}: {exc}")
                parts = []
        if not parts:
            parts = [explain.plan_table(plan)]
        console = make_console()
        for part in parts:
            console.print(part)
        write_text(run_dir / "dapple_plan.txt", "".join(render_text(part) for part in parts))

    def _simulate(self, plan: Any, profile: Any, run_dir: Path) -> None:
        if profile is None:
            self._note(run_dir, "simulated timeline not drawn: no layer profile")
            return
        cluster = self._cluster_of(plan)
        result = simulate_plan(plan, profile, load_cluster(cluster))
        write_text(run_dir / "timeline_simulated.json", json.dumps(result.to_dict(), indent=1) + "\n")
        tmp = run_dir / f".{SIMULATED_TIMELINE}.tmp.png"
        draw_timeline(
            result,
            tmp,
            title=f"simulated: {result.schedule}, M={result.micro_batches}, step {result.latency_ms:.2f} ms, "
            f"bubble {100 * result.bubble_fraction:.1f}% ({profile.device} profile, cluster {cluster.get('name')})",
        )
        os.replace(tmp, run_dir / SIMULATED_TIMELINE)

    def _note(self, run_dir: Path, text: str) -> None:
        self.notes.append(text)
        with open(run_dir / "notes.txt", "a", encoding="utf-8") as handle:
            handle.write(text + "\n")

    # -- end: measured timeline (all ranks) -----------------------------------------------
    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plan = getattr(trainer.strategy, "plan", None)
        if plan is None or not self.measured:
            return
        runner = getattr(trainer.strategy, "runner", None)
        spans = list(getattr(getattr(runner, "stats", None), "timeline", []) or [])
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        reference = time.perf_counter()  # taken right after a barrier: aligns clocks of other hosts
        gathered = gather_to_zero({"spans": spans, "reference": reference, "host": socket.gethostname()})
        if gathered is None:
            return
        run_dir = Path(self.run_dir)
        timeline = MeasuredTimeline.from_gathered(gathered, plan)
        write_text(run_dir / "timeline_measured.json", json.dumps(timeline.to_dict(), indent=1) + "\n")
        try:
            tmp = run_dir / f".{MEASURED_TIMELINE}.tmp.png"
            draw_measured_timeline(timeline, tmp)
            os.replace(tmp, run_dir / MEASURED_TIMELINE)
        except Exception as exc:
            self._note(run_dir, f"measured timeline not drawn: {type(exc).__name__}: {exc}")



def _explained(plan: Any, profile: Any, cluster: dict[str, Any]) -> list[Any]:
    """plan.explain's table and summary."""
    parts: list[Any] = [explain.plan_table(plan, profile, load_cluster(cluster))]
    summary = explain.plan_summary(plan)
    return parts + [summary] if summary else parts
