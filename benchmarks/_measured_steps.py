"""Measured against simulated step times on 4 CPU processes, for ``bench_fidelity.py --measured``
and ``bench_ooo_choice.py``.

* A tiny recipe runs as a user runs it: ``dapple-train recipe=NAME`` (``python -m
  lightning_dapple.app.train``) for ``steps`` steps in a run directory of its own. The run
  profiles the layers and the executor's overhead per action (``plan="auto"``), plans, and
  writes the plan (``dapple_plan.json``), the profile (``dapple_profile.json``), the plan
  simulated on that profile (``timeline_simulated.json``) and the measured step times
  (``step_times.json``: per step the slowest rank, median after the warm-up steps, and the
  part from ``on_before_optimizer_step`` to the step's end, ``measured_optimizer_ms``,
  against the slowest simulated stage's optimizer step, ``simulated_optimizer_ms``). The
  simulated step is re-run here without the overhead too, to show what pricing it changes.
  ``measured_busy_ms`` is the F/B/W time of the busiest rank in the run's last step
  (``timeline_measured.json``), against ``simulated_busy_ms``, the busiest simulated stage:
  how much slower the compute itself ran than the profile says (other processes on the
  same cores), apart from waits and the per-step work outside the pipeline.
* The benchmark MLP (``_schedules_worker.make_blocks``: Linear + ReLU blocks) as four
  single-rank stages, DAPPLE schedule: profiled here (layers, overhead and the SGD step per
  layer), timed on four spawned gloo ranks through ``StageRunner`` (median of ``steps`` steps
  of the slowest rank after ``warmup``), and simulated on the cluster those ranks measured
  before training (``execute/collective_probe.py``, as a run with ``cluster=auto`` does).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_dapple.cluster import detect_cluster, load_cluster
from lightning_dapple.plan.plan import load_plan, plan_from_dict
from lightning_dapple.profile.action_overhead import NO_OVERHEAD
from lightning_dapple.profile.step_glue import NO_GLUE
from lightning_dapple.profile.model_profile import ModelProfile, profile_from_dict
from lightning_dapple.simulate import simulate_plan

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TINY_RECIPES = ("bert_tiny", "gnmt_tiny", "vgg_tiny", "bert_pipeline_tiny")
WORLD = 4


def train(recipe: str, run_dir: Path, steps: int, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``dapple-train recipe=...`` for ``steps`` steps in ``run_dir``; its outputs (see
    the module docstring) as one record. Raises with the run's log tail if it failed."""
    run_dir = Path(run_dir).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [
        sys.executable, "-m", "lightning_dapple.app.train", f"recipe={recipe}", f"trainer.max_steps={steps}",
        f"hydra.run.dir={run_dir}", *overrides,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not (run_dir / "step_times.json").is_file():
        raise RuntimeError(f"{' '.join(command[2:])} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    plan = load_plan(run_dir / "dapple_plan.json")
    times = json.loads((run_dir / "step_times.json").read_text())
    record = {
        "recipe": recipe, "overrides": list(overrides), "run_dir": str(run_dir), "wall_s": time.perf_counter() - started,
        "plan": plan.kind(), "micro_batches": plan.micro_batches, "ooo": bool(plan.ooo),
        "ooo_choice": plan.extra.get("ooo_choice", ""), "measured_ms": times["median_step_ms"],
        "measured_optimizer_ms": (times.get("median_phase_ms") or {}).get("optimizer"),
        "measured_executor_ms": (times.get("median_phase_ms") or {}).get("executor"),
        "peak_memory_bytes_per_rank": times.get("peak_memory_bytes_per_rank"),
        "peak_memory_kind": times.get("peak_memory_kind"),
    }
    measured = json.loads((run_dir / "timeline_measured.json").read_text()) if (run_dir / "timeline_measured.json").is_file() else None
    if measured is not None:  # the last step's F/B/W work of the busiest rank: compute without the waits
        record["measured_busy_ms"] = max(sum(end - start for start, end, *_ in rank["spans"]) for rank in measured["ranks"].values())
    profile_file = run_dir / "dapple_profile.json"
    if profile_file.is_file():  # plan="auto" measured it; an explicit plan file has none
        profile = profile_from_dict(json.loads(profile_file.read_text()))
        record.update(simulated_pair(plan, profile, plan.extra.get("cluster")))
    return record


def simulated_pair(plan: Any, profile: ModelProfile, cluster: Any) -> dict[str, Any]:
    """The plan's simulated step on ``profile`` with its executor overhead and the user's step
    around the layers, without the overhead, and without the step's glue."""
    cluster = load_cluster(cluster) if cluster is not None else detect_cluster(1, WORLD, "cpu")  # as the strategy detects it
    result = simulate_plan(plan, profile, cluster)
    busy_per_rank: dict[int, float] = {}  # a rank holding several chunks of a chunked plan is busy with all of them
    for stage in result.stages:
        for device in stage.devices:
            busy_per_rank[device] = busy_per_rank.get(device, 0.0) + stage.busy_ms
    return {
        "simulated_ms": result.latency_ms,
        "simulated_busy_ms": max(busy_per_rank.values()),
        "simulated_optimizer_ms": max(stage.cost.optimizer_ms for stage in result.stages),
        "simulated_no_overhead_ms": simulate_plan(plan, replace(profile, action_overhead_ms=NO_OVERHEAD), cluster).latency_ms,
        "simulated_no_glue_ms": simulate_plan(plan, replace(profile, step_glue_ms=NO_GLUE), cluster).latency_ms,
        "action_overhead_ms": profile.action_overhead_ms.to_dict(),
        "step_glue_ms": profile.step_glue_ms.to_dict(),
    }


# --------------------------------------------------------------------------- the benchmark MLP


def mlp_plan(cfg: dict[str, Any]) -> Any:
    """Four single-rank stages of equal blocks, DAPPLE schedule, M = ``cfg["micro_batches"]``."""
    per = cfg["layers"] // WORLD
    return plan_from_dict({
        "global_batch_size": cfg["batch"], "micro_batches": cfg["micro_batches"], "schedule": "dapple", "ooo": cfg["ooo"],
        "stages": [{"layers": [s * per, (s + 1) * per], "devices": [s]} for s in range(WORLD)],
    })


def mlp(cfg: dict[str, Any]) -> dict[str, Any]:
    """Profile, simulate and time the benchmark MLP (module docstring)."""
    import torch

    from lightning_dapple.execute.launch import run_ranks
    from lightning_dapple.execute.overhead_probe import with_action_overhead
    from lightning_dapple.profile.optimizer_step import measure_optimizer_ms, with_optimizer_ms
    from lightning_dapple.profile.profiler import profile_layers

    sys.path.insert(0, str(HERE))
    import _schedules_worker

    torch.set_num_threads(1)
    rows = cfg["batch"] // cfg["micro_batches"]
    sample = torch.randn(rows, cfg["width"])
    blocks = _schedules_worker.make_blocks(cfg["width"], cfg["layers"])
    profile = with_action_overhead(profile_layers(blocks, sample, repeats=10, warmup=3))
    profile = with_optimizer_ms(profile, measure_optimizer_ms(list(blocks), lambda params: torch.optim.SGD(params, lr=_schedules_worker.LR)))
    plan = mlp_plan(cfg)
    record = {"recipe": "mlp", "plan": plan.kind(), "micro_batches": plan.micro_batches, "ooo": cfg["ooo"]}
    by_rank = run_ranks(_mlp_rank, WORLD, cfg, timeout_s=600, raise_on_error=True)
    record.update(simulated_pair(plan, profile, by_rank[0][2]))
    record["measured_ms"] = 1e3 * statistics.median(max(by_rank[r][0][i] for r in by_rank) for i in range(cfg["steps"]))
    record["measured_busy_ms"] = 1e3 * max(busy for _, busy, _ in by_rank.values())
    return record


def _mlp_rank(rank: int, world: int, cfg: dict[str, Any]) -> tuple[list[float], float, dict[str, Any]]:
    """This rank's wall seconds per timed step (each step starts at a barrier), its F/B/W
    seconds in the last step, and the cluster as measured before training."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    import _schedules_worker

    from lightning_dapple.execute.collective_probe import with_measured_links
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner

    torch.set_num_threads(1)
    cluster = with_measured_links(detect_cluster(1, world, "cpu"), torch.device("cpu"))
    failure = FailureChannel(rank, timeout_s=120)
    plan = mlp_plan(cfg)
    layers = _schedules_worker.make_blocks(cfg["width"], cfg["layers"])
    stage = plan.stages[rank]
    runner = StageRunner.for_plan(plan, rank, layers[stage.start : stage.end], torch.device("cpu"), failure, ties=())
    optimizer = torch.optim.SGD(runner.parameters, lr=_schedules_worker.LR)
    callbacks = _schedules_worker._Callbacks()
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        batch = _schedules_worker.make_batch(step, cfg["batch"], cfg["width"])
        dist.barrier()
        start = time.perf_counter()
        runner.train_step(batch, callbacks)
        optimizer.step()
        if step >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    busy = sum(span[1] - span[0] for span in runner.stats.timeline)
    runner.finish()
    failure.close()
    return times, busy, cluster.to_dict()


def ratio_text(record: dict[str, Any]) -> str:
    """measured / simulated, as the tables print it."""
    return f"{record['measured_ms'] / record['simulated_ms']:.2f}" if record.get("simulated_ms") else "-"
