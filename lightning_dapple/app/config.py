"""Structured configs of ``dapple-train``: the schema Hydra checks every YAML and override against.

The YAML files live in ``lightning_dapple/conf`` (config groups ``trainer``, ``strategy``,
``cluster``, ``model``, ``data``, ``logger`` and ``recipe``); this module registers their
schema in Hydra's ConfigStore as ``app_schema``, which the primary ``config.yaml`` lists
first in its defaults. A key that is not in the schema (a typo such as
``strategy.micro_batch=4``) or a value of the wrong type (``strategy.micro_batches=four``,
``strategy.schedule=pipedream``) therefore fails while Hydra composes the config, before
any output directory exists.

``model`` and ``data`` are open mappings (``name`` plus the constructor's keyword
arguments); the app checks their keys against the constructors before it builds anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from importlib.resources import files
from typing import Any, Dict, Optional

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING

__all__ = [
    "AppConfig",
    "ClusterConfig",
    "Launcher",
    "LoggerConfig",
    "OutputsConfig",
    "Policy",
    "Recompute",
    "Schedule",
    "StrategyConfig",
    "StrategyName",
    "TrainerConfig",
    "compose_recipe",
    "enum_value",
    "group_options",
    "recipe_names",
    "register_configs",
]


class StrategyName(Enum):
    """``dapple``: pipeline/data parallel on ``trainer.devices`` processes; ``single``: a
    plain Lightning Trainer on one device (the reference the pipeline must reproduce)."""

    dapple = "dapple"
    single = "single"


class Schedule(Enum):
    auto = "auto"  # the fastest simulated schedule that fits (plan/schedule_choice.py)
    dapple = "dapple"  # early backward (DAPPLE 3.2, 5.3)
    gpipe = "gpipe"  # all forwards, then all backwards (GPipe)
    interleaved = "interleaved"  # Megatron's interleaved 1F1B, several chunks per device group
    zbv = "zbv"  # zero-bubble V: 2 chunks per device group, B and W split


class Policy(Enum):
    PA = "PA"  # K_i = min(S - i, M)       (DAPPLE 5.3)
    PB = "PB"  # K_i = min(2(S - i) - 1, M)
    auto = "auto"


class Recompute(Enum):
    never = "never"
    except_last = "except_last"
    always = "always"
    auto = "auto"


class Launcher(Enum):
    """How the worker processes start (see ``lightning_dapple.app.train``).

    ``auto``: ``fork`` on Linux CPU runs, ``spawn`` otherwise. ``spawn``/``fork``: Lightning's
    multiprocessing launcher inside the Hydra job (works with ``-m`` sweeps). ``external``:
    the processes were started by torchrun/SLURM (one ``dapple-train`` per rank, with a
    fixed ``hydra.run.dir``); Lightning's own subprocess launcher is never used because it
    re-executes ``sys.argv``, which under Hydra would start a new run or sweep per rank.
    """

    auto = "auto"
    spawn = "spawn"
    fork = "fork"
    external = "external"


@dataclass
class TrainerConfig:
    """Arguments passed to ``lightning.pytorch.Trainer`` (``default_root_dir`` is the run dir)."""

    accelerator: str = "cpu"
    devices: int = 4
    num_nodes: int = 1
    max_steps: int = 100
    max_epochs: Optional[int] = None
    precision: str = "32-true"
    log_every_n_steps: int = 1
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    limit_val_batches: Optional[Any] = None
    limit_train_batches: Optional[Any] = None
    num_sanity_val_steps: int = 0
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    enable_checkpointing: bool = False
    deterministic: bool = False


@dataclass
class StrategyConfig:
    """Options of ``DappleStrategy`` (docs/user-guide.md, docs/formats.md).

    ``plan``: ``auto`` (profile + DAPPLE planner at the first fit), a plan JSON path, or
    an inline plan mapping. ``micro_batches``/``schedule``/``policy`` override the plan's
    M, schedule and K_i policy; ``ooo`` (out-of-order backprop: true, false or auto) and
    ``recompute`` are handed to the strategy, and so is ``zero`` (0, 1, 2 or auto: ZeRO over a
    replicated stage's replicas, docs/user-guide.md). ``timeout_s`` bounds every wait for a
    peer; ``layers`` is the attribute path of the model's layer sequence. ``tune_steps``
    (with ``plan: auto``) measures the simulator's best ``tune_candidates`` plans for that many
    steps each and keeps the fastest (``strategy/plan_tuning.py``); ``profile_cache`` keeps
    profiles and measured choices between runs.
    """

    name: StrategyName = StrategyName.dapple
    plan: Any = "auto"
    micro_batches: Optional[int] = None
    schedule: Optional[Schedule] = None
    policy: Optional[Policy] = None
    ooo: Any = "auto"  # true | false | auto
    zero: Any = 0  # 0 | 1 | 2 | auto: optimizer state (and gradients under 2) sharded over a stage's replicas
    wire: str = "auto"  # auto | gloo | staged | nccl (execute/transfer/wires.py)
    recompute: Optional[Recompute] = None
    timeout_s: float = 120.0
    layers: str = "layers"
    loss_reduction: str = "mean"
    launcher: Launcher = Launcher.auto
    tune_steps: int = 0  # >0: measure the simulator's best few plans for this many steps each and keep the fastest (plan: auto)
    tune_candidates: int = 4  # how many plans tune_steps measures
    profile_cache: Optional[str] = None  # directory for cached profiles and measured plan choices


@dataclass
class ClusterConfig:
    """The hardware the planner plans for (``lightning_dapple.cluster.Cluster``)."""

    name: str = "custom"
    machines: int = 1
    devices_per_machine: int = 1
    intra_bandwidth_gbps: float = 300.0
    inter_bandwidth_gbps: float = 25.0
    device_memory_gib: float = 16.0
    optimizer_state_factor: float = 2.0
    latency_ms: float = 0.0
    shared_cores: Optional[int] = None  # CPU processes: the cores they share (cluster=auto detects them)
    allreduce_latency_ms: Optional[float] = None  # fixed cost per AllReduce of 2 devices; null: latency_ms (cluster=auto measures it)
    allreduce_latency_per_rank_ms: float = 0.0  # added to it per device beyond 2


@dataclass
class LoggerConfig:
    """``csv``: Lightning's CSVLogger writing ``metrics.csv`` into the run dir; ``none``: no logger."""

    name: str = "csv"
    flush_logs_every_n_steps: int = 50


@dataclass
class OutputsConfig:
    """What each run writes besides the config, plan JSON and metrics.

    ``warmup_steps``: steps left out of the median step time (process start, first-touch).
    """

    plan_table: bool = True
    simulated_timeline: bool = True
    measured_timeline: bool = True
    warmup_steps: int = 5


@dataclass
class AppConfig:
    name: str = MISSING
    seed: int = 0
    ckpt_path: Optional[str] = None  # resume: the checkpoint file trainer.fit starts from
    threads: int = 1
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    outputs: OutputsConfig = field(default_factory=OutputsConfig)


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="app_schema", node=AppConfig)


def enum_value(value: Any) -> Any:
    """The plain value of a config enum (``None`` stays ``None``)."""
    return value.value if isinstance(value, Enum) else value


CONFIG_MODULE = "lightning_dapple.conf"
PRIMARY_CONFIG = "config"


def compose_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The composed config of ``recipe=<name>`` (plus ``overrides``), outside a Hydra app.

    Used by ``recipe_profile`` and tests. Inside a running Hydra app the global Hydra
    state already exists; it is then saved and restored around the compose.
    """
    register_configs()
    instance = GlobalHydra.instance()
    saved = instance.hydra if instance.is_initialized() else None
    if saved is not None:
        instance.clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return compose(config_name=PRIMARY_CONFIG, overrides=[f"recipe={name}", *overrides])
    finally:
        if saved is not None:
            GlobalHydra.instance().initialize(saved)


def group_options(group: str) -> list[str]:
    """The options of a config group shipped in ``lightning_dapple/conf/<group>``."""
    folder = files(CONFIG_MODULE).joinpath(group)
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def recipe_names() -> list[str]:
    """The recipes shipped in ``lightning_dapple/conf/recipe``."""
    return group_options("recipe")
