"""``dapple-train``: train a recipe (BERT, GNMT, VGG-19) with ``Trainer(strategy="dapple")`` under Hydra.

    dapple-train recipe=bert_tiny                                  # 4 CPU processes, plan=auto
    dapple-train recipe=gnmt_tiny strategy.micro_batches=8 trainer.max_steps=50
    dapple-train recipe=bert_tiny strategy=single                  # plain Lightning, 1 device
    dapple-train -m recipe=vgg_tiny strategy.schedule=dapple,gpipe strategy.micro_batches=4,8

Each run directory (``outputs/<recipe>/<time>``, or ``multirun/<time>/<job>_<recipe>``) gets:
``config.yaml`` (resolved config; Hydra's own copies are in ``.hydra/``), ``dapple_plan.json``
and ``dapple_plan.txt`` (the plan and its table: the strategy writes them into Lightning's
log dir, which is the run dir), ``dapple_profile.json`` (the measured layer profile),
``timeline_simulated.png`` (the plan simulated with that profile), ``timeline_measured.png`` (every rank's F/B/W spans of the last step),
``metrics.csv`` (Lightning's CSVLogger), ``step_times.json`` and ``result.json``. After a
sweep, a table of measured and simulated step time and peak stashed memory per run is
printed and written as ``summary.csv`` and ``summary.txt`` in the sweep directory.

Launching the worker processes. Lightning's default launcher for multi-process CPU/GPU
runs (``strategy="dapple"``: the subprocess launcher) starts the other ranks by
re-executing ``sys.argv``. Under Hydra that re-runs ``dapple-train`` itself: every rank
would compose its own config, create its own run directory and, under ``-m``, start the
whole sweep again. The app therefore launches the ranks from inside the Hydra job with
Lightning's multiprocessing launcher (``DappleStrategy(start_method=...)``), which calls
the fit function in the new processes instead of re-running the command line, so single
runs and ``-m`` sweeps work alike. ``strategy.launcher=spawn`` starts fresh interpreters
(safe with CUDA and on every OS; each rank re-imports torch and Lightning: about 20 s for 4
ranks on 2 cores); ``fork`` copies the already-initialised job process (well under a
second; Linux CPU only, never after CUDA was initialised). ``auto`` (default) picks fork
for CPU runs on Linux and spawn otherwise. ``external`` is for torchrun/SLURM, which start
one ``dapple-train`` per rank themselves (give every rank the same ``hydra.run.dir``).

``ckpt_path=FILE`` resumes from a checkpoint (``trainer.enable_checkpointing=true`` writes one
per epoch and ``checkpoints/last.ckpt``); ``cluster=/path/to/file.yaml`` plans for a cluster
file (``app/command_line.py``).

Bad configuration (unknown recipe or option, a wrongly typed value, micro-batches that do
not divide the global batch, more devices than the machine or cluster has, a plan that does
not fit the model) ends with one ``dapple-train: error: ...`` line on stderr and exit code
2; it is found before training starts and the run directory Hydra created is removed.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from hydra.utils import to_absolute_path
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_dapple.app.callbacks import (
    PipelineReport,
    StepTimer,
    WorkerSetup,
    quiet_warnings,
)
from lightning_dapple.app.command_line import (
    check_known_keys,
    cluster_file_overrides,
    hydra_error_line,
)
from lightning_dapple.app.config import enum_value, register_configs
from lightning_dapple.app.run_results import (
    loss_curve,
    plan_record,
    print_run_summary,
    run_outputs,
)
from lightning_dapple.app.summary import RESULTS
from lightning_dapple.atomic_files import atomic_write_text as write_text
from lightning_dapple.cluster import detect_cluster, usable_cores
from lightning_dapple.data import DATAMODULES
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.slicing import take_rows
from lightning_dapple.models import MODELS
from lightning_dapple.plan.plan import Plan, PlanShape, plan_or_shape_from_dict
from lightning_dapple.profile.profiler import profile_layers
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.module_adapter import (
    LogRecorder,
    capture_input,
    find_layers,
)
from lightning_dapple.strategy.ooo_choice import check_ooo
from lightning_dapple.strategy.resolve import (
    PlanArguments,
    resolve_plan,
    shape_with_arguments,
)

__all__ = ["main", "prepare", "run_job"]

PROG = "dapple-train"
# error lines of the jobs this process ran that failed (decides the exit code)
FAILED: list[tuple[str, str]] = []
# what Hydra puts into a fresh run directory before the job starts
_HYDRA_FILES = {".hydra", f"{PROG}.log"}

register_configs()


# --------------------------------------------------------------------------- entry point


@hydra.main(config_path="pkg://lightning_dapple.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    run_job(cfg)


def main() -> None:
    """Console script ``dapple-train``: Hydra's command line (overrides, ``-m``, ``--cfg job``)."""
    try:
        sys.argv[1:] = cluster_file_overrides(sys.argv[1:])  # cluster=/path/to/file.yaml
    except DappleConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    # Let Hydra's own errors (composition, override parsing, schema validation) reach us
    # so that they are reported on one line.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    FAILED.clear()
    try:
        _hydra_main()
    except Exception as exc:
        if user_full_error or not _is_hydra_config_error(exc):
            raise
        print(f"{PROG}: error: {hydra_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    finally:
        if not user_full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)
    if FAILED:
        sys.exit(2 if any(kind == "config" for kind, _ in FAILED) else 1)


def _is_hydra_config_error(exc: BaseException) -> bool:
    return isinstance(exc, (HydraException, OmegaConfBaseException))


# --------------------------------------------------------------------------- one job


@dataclass
class Job:
    """Everything a validated run needs; nothing of it has been written yet."""

    cfg: DictConfig
    run_dir: Path
    strategy_name: str
    model: Any
    datamodule: Any
    trainer: Any
    world_size: int
    launcher: str
    notes: list[str] = field(default_factory=list)
    ckpt_path: str | None = None  # resume from this checkpoint file (cfg.ckpt_path)


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """The Hydra task: validate, train, write the run's outputs; returns the result record."""
    quiet_warnings()
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    record: dict[str, Any] = {
        "name": cfg.get("name"),
        "job": int(hc.job.num) if multirun else None,
        "overrides": list(hc.overrides.task),
        "run_dir": str(run_dir),
        "sweep_dir": (str(run_dir.parent) if "/" not in str(hc.sweep.subdir) else str(hc.sweep.dir)) if multirun else None,
    }
    initial = set(os.listdir(run_dir)) if run_dir.is_dir() else set()
    try:
        job = prepare(cfg, run_dir)
    except DappleConfigError as exc:
        return _config_failure(str(exc), record, run_dir, initial)
    try:
        result = execute(job, record)
    except BaseException as exc:
        line = worker_config_error(exc)
        if line is not None:  # e.g. plan="auto" found no plan: the workers raised DappleConfigError
            return _config_failure(line, record, run_dir, initial)
        record.update(status="error", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        try:
            write_text(run_dir / "result.json", json.dumps(record, indent=2) + "\n")
            write_text(run_dir / "FAILED", traceback.format_exc())
        except OSError:
            pass
        RESULTS.append(record)
        FAILED.append(("error", record["error"]))
        if multirun and isinstance(exc, Exception):
            print(f"{PROG}: job {record['job']} failed: {record['error']}", file=sys.stderr)
            traceback.print_exc()
            return record
        raise
    RESULTS.append(result)
    return result


def _config_failure(line: str, record: dict[str, Any], run_dir: Path, initial: set[str]) -> dict[str, Any]:
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    remove_run_dir(run_dir, initial)
    record.update(status="config error", error=line, run_dir=None)
    RESULTS.append(record)
    FAILED.append(("config", line))
    return record


def remove_run_dir(run_dir: Path, initial: set[str]) -> None:
    """Undo the run directory: all of it when Hydra made it for this job, else only what
    appeared in it since the job started (never the working directory or its parents)."""
    run_dir = run_dir.resolve()
    if not run_dir.is_dir():
        return
    cwd = Path.cwd().resolve()
    fresh = initial <= _HYDRA_FILES and run_dir != cwd and run_dir not in cwd.parents
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in set(os.listdir(run_dir)) - initial:
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


_CONFIG_ERROR = re.compile(r"DappleConfigError: (.+)")


def worker_config_error(exc: BaseException) -> str | None:
    """The message of a DappleConfigError raised in a worker process, if that is what ``exc`` carries."""
    if isinstance(exc, DappleConfigError):
        return str(exc)
    text = str(exc)
    matches = _CONFIG_ERROR.findall(text)
    return matches[-1].strip() if matches else None


# --------------------------------------------------------------------------- validation and building


def _signature_keys(cls: type) -> set[str]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {name for name, p in inspect.signature(cls.__init__).parameters.items() if name != "self" and p.kind in kinds}


def _kwargs(section: DictConfig, registry: dict[str, type], group: str) -> tuple[type, dict[str, Any]]:
    values = OmegaConf.to_container(section, resolve=True)
    require(isinstance(values, dict) and "name" in values, f"{group}.name", "is missing", f"pick one of {sorted(registry)} (e.g. {group}=<option>)")
    name = values.pop("name")
    require(name in registry, f"{group}.name", f"is {name!r}", f"use one of {sorted(registry)}")
    cls = registry[name]
    allowed = _signature_keys(cls)
    unknown = sorted(set(values) - allowed)
    require(not unknown, f"{group}.{unknown[0] if unknown else ''}", f"is not an option of {cls.__name__}", f"use only {sorted(allowed)}")
    return cls, values


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve_launcher(requested: str, accelerator: str) -> str:
    if requested == "external":
        require(
            "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ,
            "strategy.launcher",
            "is 'external' but no torchrun/SLURM environment (LOCAL_RANK, WORLD_SIZE) is set",
            "start dapple-train with torchrun (same hydra.run.dir on every rank), or use launcher=auto",
        )
        return "popen"
    if requested == "auto":
        return "fork" if accelerator == "cpu" and sys.platform.startswith("linux") else "spawn"
    return requested


def _accelerator(name: str) -> str:
    name = str(name).lower()
    if name == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if name == "cuda" else name


def _explicit_plan(spec: Any, cfg: DictConfig) -> dict[str, Any] | None:
    """The plan mapping of an explicit ``strategy.plan`` (a file or an inline mapping); None for auto."""
    if isinstance(spec, DictConfig):
        return OmegaConf.to_container(spec, resolve=True)  # type: ignore[return-value]
    if isinstance(spec, str) and spec != "auto":
        path = Path(to_absolute_path(spec))
        require(path.is_file(), "strategy.plan", f"{spec!r} is neither 'auto' nor a plan file", "give 'auto' or the path of a plan JSON (dapple-plan --json --out FILE)")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DappleConfigError("strategy.plan", f"{path.name} is not valid JSON ({exc.msg} at line {exc.lineno})", "fix the plan file") from None
    require(spec == "auto", "strategy.plan", f"is {spec!r}", "give 'auto', a plan JSON path, or an inline plan mapping")
    return None


def prepare(cfg: DictConfig, run_dir: Path) -> Job:
    """Check the whole configuration and build model, data and Trainer; writes nothing.

    Raises DappleConfigError (one line: what, problem, fix) on bad configuration.
    """
    check_known_keys(cfg)
    threads = int(cfg.threads)
    require(threads >= 0, "threads", f"is {threads}", "use 1 (one torch thread per process) or more; 0 keeps torch's default")
    if threads > 0:
        torch.set_num_threads(threads)
    strategy_name = enum_value(cfg.strategy.name)
    dapple = strategy_name == "dapple"
    model_cls, model_kwargs = _kwargs(cfg.model, MODELS, "model")
    data_cls, data_kwargs = _kwargs(cfg.data, DATAMODULES, "data")
    where = _devices(cfg, dapple)
    batch = data_kwargs.get("batch_size")
    require(isinstance(batch, int) and batch > 0, "data.batch_size", f"is {batch!r}", "give the global batch of one optimizer step")
    arguments = _plan_arguments(cfg, batch) if dapple else PlanArguments()
    plan_dict = _explicit_plan(cfg.strategy.plan, cfg) if dapple else None
    launcher = _resolve_launcher(enum_value(cfg.strategy.launcher), where.accelerator) if dapple else "none"

    notes: list[str] = []
    model, datamodule = _model_and_data(cfg, model_cls, model_kwargs, data_cls, data_kwargs, notes)
    layers_path = str(cfg.strategy.layers)
    plan = _checked_plan(plan_dict, arguments, model, layers_path, where.world, batch) if plan_dict is not None else None

    tcfg = _trainer_options(cfg, where, data_kwargs, batch)
    callbacks: list[Any] = [WorkerSetup(threads), StepTimer(str(run_dir), int(cfg.outputs.warmup_steps))]
    if tcfg.get("enable_checkpointing"):  # one per epoch (Lightning's default) and checkpoints/last.ckpt to resume from
        callbacks.append(ModelCheckpoint(dirpath=str(run_dir / "checkpoints"), save_last=True))
    if tcfg.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar(leave=True))
    strategy: Any = "auto"
    if dapple:
        os.environ.pop("MASTER_PORT", None)  # a fresh port per job (a sweep runs many in one process)
        profile = None
        if plan is not None and cfg.outputs.simulated_timeline:
            profile = _profile_for_plan(model, datamodule, layers_path, plan.micro_batch_size)
        callbacks.append(
            PipelineReport(
                str(run_dir),
                cluster=where.cluster,
                profile=profile,
                table=bool(cfg.outputs.plan_table),
                simulated=bool(cfg.outputs.simulated_timeline),
                measured=bool(cfg.outputs.measured_timeline),
            )
        )
        strategy = DappleStrategy(
            plan=plan_dict if plan_dict is not None else "auto",
            micro_batches=arguments.micro_batches,
            schedule=arguments.schedule,
            policy=arguments.policy,
            recompute=arguments.recompute,
            ooo=arguments.ooo,
            zero=arguments.zero if arguments.zero is not None else 0,
            wire=cfg.strategy.wire,
            cluster=None if where.detected else where.cluster,  # None: the strategy detects it and measures its AllReduce
            layers=layers_path,
            loss_reduction=str(cfg.strategy.loss_reduction),
            timeout_s=float(cfg.strategy.timeout_s),
            start_method=launcher,
            tune_steps=int(cfg.strategy.tune_steps),
            tune_candidates=int(cfg.strategy.tune_candidates),
            profile_cache=cfg.strategy.profile_cache,
        )
    try:
        trainer = Trainer(strategy=strategy, logger=_logger(cfg, run_dir), callbacks=callbacks, default_root_dir=str(run_dir), **tcfg)
    except (ValueError, TypeError) as exc:  # Lightning's MisconfigurationException is a ValueError
        if isinstance(exc, DappleConfigError):
            raise
        raise DappleConfigError("trainer", str(exc).splitlines()[0], "fix the trainer.* option it names") from None
    return Job(cfg, run_dir, strategy_name, model, datamodule, trainer, where.world, launcher, notes, _checkpoint(cfg.ckpt_path))


def _checkpoint(spec: str | None) -> str | None:
    """``ckpt_path``: the checkpoint file a run resumes from (relative to where dapple-train started)."""
    if spec is None:
        return None
    path = Path(to_absolute_path(str(spec)))
    require(path.is_file(), "ckpt_path", f"{spec!r} is not a file", "give a checkpoint of an earlier run (its checkpoints/last.ckpt; trainer.enable_checkpointing=true writes it)")
    return str(path)


@dataclass(frozen=True)
class _Devices:
    """Where the run goes: accelerator, processes per node, nodes, their product, and the
    cluster (a mapping, as ``DappleStrategy(cluster=...)`` takes it) it is planned for."""

    accelerator: str
    devices: int
    num_nodes: int
    world: int
    cluster: dict[str, Any]
    detected: bool  # cluster=auto: this machine, as detect_cluster sees it


def _devices(cfg: DictConfig, dapple: bool) -> _Devices:
    """What the run asks for, checked against what the machine and the cluster have."""
    accelerator = _accelerator(cfg.trainer.accelerator)
    devices = int(cfg.trainer.devices) if dapple else 1
    num_nodes = int(cfg.trainer.num_nodes) if dapple else 1
    require(devices >= 1, "trainer.devices", f"is {devices}", "use 1 or more processes per node")
    require(num_nodes >= 1, "trainer.num_nodes", f"is {num_nodes}", "use 1 or more nodes")
    if accelerator == "gpu":
        have = torch.cuda.device_count()
        require(
            devices <= have,
            "trainer.devices",
            f"asks for {devices} GPUs but this machine has {have}",
            f"use trainer.devices={have} or fewer" if have else "run on CPU processes (trainer=cpu) or on a machine with GPUs",
        )
    world = devices * num_nodes
    cluster = _cluster(cfg, num_nodes, devices, accelerator)
    capacity = int(cluster["machines"]) * int(cluster["devices_per_machine"])
    if dapple:
        require(
            world <= capacity,
            "trainer.devices",
            f"asks for {world} devices ({num_nodes} node(s) x {devices}) but cluster {cluster.get('name')!r} has {capacity}",
            f"use at most {capacity} devices or a larger cluster (cluster=...)",
        )
    if accelerator == "cpu" and devices > 2 * usable_cores():  # a warning: sharing cores is allowed, and slow
        print(
            f"{PROG}: warning: trainer.devices={devices} starts {devices} processes on {usable_cores()} CPU cores: they take turns on the cores, "
            f"so each step takes longer than on fewer processes (trainer.devices={usable_cores()} or fewer run side by side)",
            file=sys.stderr, flush=True,
        )
    return _Devices(accelerator, devices, num_nodes, world, cluster, cfg.cluster.get("name") == "auto")


def _plan_arguments(cfg: DictConfig, batch: int) -> PlanArguments:
    """The ``strategy`` group's plan arguments, the ones ``DappleStrategy`` takes."""
    micro = cfg.strategy.micro_batches
    if micro is not None:
        require(micro >= 1, "strategy.micro_batches", f"is {micro}", "use a positive number of micro-batches")
        require(
            batch % micro == 0,
            "strategy.micro_batches",
            f"{micro} does not divide the global batch {batch} (data.batch_size)",
            f"use one of {_divisors(batch)}",
        )
    return PlanArguments(
        micro_batches=micro,
        schedule=enum_value(cfg.strategy.schedule),
        policy=enum_value(cfg.strategy.policy),
        recompute=enum_value(cfg.strategy.recompute),
        ooo=check_ooo(cfg.strategy.ooo),
        zero=_zero_setting(cfg.strategy.zero),
    )


def _zero_setting(value: Any) -> int | str:
    """``strategy.zero`` as the strategy takes it: 0, 1, 2 or "auto" (YAML gives ints or strings)."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value


def _model_and_data(cfg: DictConfig, model_cls: Any, model_kwargs: dict, data_cls: Any, data_kwargs: dict, notes: list[str]) -> tuple[Any, Any]:
    """The model and data module (their constructors check their values), seeded."""
    L.seed_everything(int(cfg.seed), verbose=False)
    try:
        model = model_cls(**model_kwargs)
        datamodule = data_cls(**data_kwargs)
    except TypeError as exc:
        raise DappleConfigError("model/data", str(exc), "check the option names and types") from None
    clash = sorted(k for k in set(model_kwargs) & set(data_kwargs) if model_kwargs[k] != data_kwargs[k])
    if clash:
        # Legitimate (e.g. generated data using fewer word ids or classes than the model has),
        # but Lightning refuses to log module and datamodule hparams that disagree; the
        # run's config.yaml records both sides anyway.
        datamodule._log_hyperparams = False
        notes.append(f"data hparams not logged (differ from the model's: {', '.join(clash)})")
    return model, datamodule


def _checked_plan(plan_dict: dict[str, Any], arguments: PlanArguments, model: Any, layers_path: str, world: int, batch: int) -> Plan | None:
    """An explicit plan as the strategy will run it (``resolve_plan``), checked against the
    model's layers, the world size and the global batch before anything starts. A plan shape
    (stages giving devices alone) is checked for the world size and the batch and gives
    None: the strategy's planner cuts it on the profile it measures, as for plan="auto"."""
    given = plan_or_shape_from_dict(plan_dict, source="strategy.plan")
    if isinstance(given, PlanShape):
        shape_with_arguments(given, arguments).validate(world_size=world)
        _check_global_batch(given.global_batch_size, batch)
        return None
    plan = resolve_plan(given, arguments)
    plan.validate(num_layers=len(find_layers(model, layers_path)), world_size=world)
    _check_global_batch(plan.global_batch_size, batch)
    return plan


def _check_global_batch(planned: int, batch: int) -> None:
    require(
        planned == batch,
        "strategy.plan.global_batch_size",
        f"is {planned} but data.batch_size is {batch}",
        "make them equal: the DataLoader's batch is the global batch of one step",
    )


def _trainer_options(cfg: DictConfig, where: _Devices, data_kwargs: dict[str, Any], batch: int) -> dict[str, Any]:
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(tcfg, dict)
    tcfg.update(devices=where.devices, num_nodes=where.num_nodes)
    if tcfg.get("max_epochs") is None and (tcfg.get("max_steps") or -1) > 0 and data_kwargs.get("path") is None:
        # generated data: an epoch has num_samples // batch_size steps (drop_last); saying
        # so gives Lightning a finite epoch count (its progress bar shows "Epoch 0/-2" else)
        per_epoch = int(data_kwargs.get("num_samples", batch)) // batch
        if per_epoch > 0:
            tcfg["max_epochs"] = -(-int(tcfg["max_steps"]) // per_epoch)
    return tcfg


def _logger(cfg: DictConfig, run_dir: Path) -> Any:
    if cfg.logger.name == "csv":
        return CSVLogger(save_dir=str(run_dir), name="", version="", flush_logs_every_n_steps=int(cfg.logger.flush_logs_every_n_steps))
    require(cfg.logger.name == "none", "logger.name", f"is {cfg.logger.name!r}", "use csv or none")
    return False


def _cluster(cfg: DictConfig, num_nodes: int, devices: int, accelerator: str) -> dict[str, Any]:
    """``cluster=auto`` (the default): this machine as the run uses it (the GPUs' name and
    memory, else the host's memory and cores per CPU process); otherwise the configured
    cluster, on CPU processes with this machine's cores where it names none: the run's
    processes share them, whatever the file says of memory and links."""
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    assert isinstance(cluster, dict)
    if cluster.get("name") != "auto":
        if accelerator == "cpu" and cluster.get("shared_cores") is None:
            cluster["shared_cores"] = usable_cores()
        return cluster
    return detect_cluster(num_nodes, devices, accelerator).to_dict()


def _profile_for_plan(model: Any, datamodule: Any, layers_path: str, rows: int) -> dict[str, Any]:
    """Profile the layers on one micro-batch of ``rows`` samples, as plan="auto" would (for
    drawing the simulated timeline of an explicit plan)."""
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    piece = take_rows(batch, 0, max(1, rows))
    with LogRecorder().recording(model, 0.0):
        x = capture_input(model, lambda: model.training_step(piece, 0))
    with torch.random.fork_rng():
        profile = profile_layers(find_layers(model, layers_path), x, device="cpu", name=type(model).__name__)
    return profile.to_dict()


# --------------------------------------------------------------------------- training and results


def execute(job: Job, record: dict[str, Any]) -> dict[str, Any]:
    cfg, run_dir = job.cfg, job.run_dir
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    if job.strategy_name == "single":
        resolved["trainer"].update(devices=1, num_nodes=1)
    write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(resolved)))
    # torch logs a warning per sibling it terminates after a worker failed; the failure
    # itself is reported (one line for bad configuration, a traceback otherwise)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    started = time.perf_counter()
    with warnings.catch_warnings():
        quiet_warnings()
        job.trainer.fit(job.model, datamodule=job.datamodule, ckpt_path=job.ckpt_path)
    wall_s = time.perf_counter() - started
    result = dict(record)
    result.update(status="ok", error=None, strategy=job.strategy_name, devices=job.world_size, launcher=job.launcher, wall_s=round(wall_s, 3))
    result.update(run_outputs(run_dir))
    result["plan"] = plan_record(run_dir / "dapple_plan.json") if job.strategy_name == "dapple" else {"kind": "single", "micro_batches": 1, "schedule": None}
    result["metrics"] = {key: float(value) for key, value in job.trainer.callback_metrics.items() if getattr(value, "numel", lambda: 1)() == 1}
    result["train_loss_curve"] = loss_curve(run_dir / "metrics.csv")
    result["notes"] = job.notes
    write_text(run_dir / "result.json", json.dumps(result, indent=2) + "\n")
    print_run_summary(result)
    return result


if __name__ == "__main__":
    main()
