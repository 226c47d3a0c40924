"""``Trainer(strategy="dapple")``: DAPPLE hybrid pipeline/data parallelism for Lightning.

The strategy reuses Lightning's DDP machinery for what is the same (launchers, process
group set-up, cluster environments) and replaces what differs:

* ``setup`` resolves the plan (a file, a Plan, or ``"auto"``: profile + plan, DAPPLE 4),
  keeps only this rank's stage of the layer sequence (the rest are freed before the
  optimizer is built, so ``configure_optimizers`` sees local parameters), and builds the
  schedule (DAPPLE 3.2/5.3 early backward or GPipe) and the process groups;
* ``training_step`` runs the whole schedule for the global batch: every micro-batch's
  forward and backward, split-concat transfers, and the per-stage gradient AllReduce
  (5.2.3). ``backward`` then only restores the gradients it computed (Lightning zeroes
  gradients between the step and the backward call) and runs the backward hooks;
* placement: setup's checks, the sample batch and the auto plan's profile run where
  the module was built (normally the CPU; the profiler moves one layer at a time to the
  device), the other stages' layers are freed to the meta device, and only then does
  this rank's stage move to its device, so the whole model never has to fit one device;
* precision: the "true" precisions convert the module as Lightning does; "bf16-mixed"
  and "16-mixed" use Lightning's MixedPrecision as ``DappleMixedPrecision``
  (``precision.py``: autocast around every stage forward and recomputation, fp32 master
  weights, an fp16 GradScaler whose skip decision is agreed by every rank);
* ``Trainer(accumulate_grad_batches=N)`` adds N pipelined steps' gradients, as plain
  Lightning adds N batches';
* gradient clipping by norm uses the global norm over all stages (the precision plugins'
  pipeline forms, ``precision.py``);
* the batch stays where the DataLoader put it: each stage moves to its device only the
  rows of its slices and the fields its step reads (``slice_transfer.py``), unless the
  module defines its own ``transfer_batch_to_device``/``on_after_batch_transfer``, which
  then move the whole batch as in Lightning;
* options of ``DDPStrategy`` that only DDP's wrapper would use are refused
  (``ddp_options.py``);
* checkpoints are consolidated: one file, the module's original state-dict keys,
  optimizer state keyed by parameter name, written atomically (see ``checkpoint.py``);
  or, with ``checkpoint="sharded"``, a directory each stage leader writes its own part of
  through ``torch.distributed.checkpoint`` (``sharded_checkpoint.py``);
* a model made in ``configure_model`` (or under ``Trainer.init_module(empty_init=True)``) is
  built on the meta device and each rank makes only its stage (``meta_build.py``), a
  Hugging Face model's from a pretrained directory (``hf_weights.py``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ContextManager, Generator, Literal, Sequence

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils import _pytree as pytree
from typing_extensions import override

from lightning_dapple.cluster import detect_cluster, load_cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.batchnorm import convert_batchnorm
from lightning_dapple.execute.chunked import ChunkedRunner
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import PlanGroups, build_groups
from lightning_dapple.execute.random_layers import draws_random
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.shutdown import destroy_groups_at_exit
from lightning_dapple.execute.store_sync import StoreSync
from lightning_dapple.execute.slicing import batch_size_of, take_rows
from lightning_dapple.execute.topology import report_placement
from lightning_dapple.execute.wires import WIRES, choose_wire
from lightning_dapple.plan.console import make_console, render_text
from lightning_dapple.plan.explain import plan_summary, plan_table
from lightning_dapple.plan.plan import Plan, atomic_write_text
from lightning_dapple.profile.hf_layers import is_hf_layer_list
from lightning_dapple.profile.ties import TiedParameter, tied_parameters
from lightning_dapple.profile.traced_layers import TracedLayers
from lightning_dapple.strategy import checkpoint as ckpt
from lightning_dapple.strategy import sharded_checkpoint as sharded
from lightning_dapple.strategy.auto_plan import PlanningContext, PlanningInputs, auto_plan, simulated_as_run
from lightning_dapple.strategy.batch_guard import check_training_batch, check_training_loss
from lightning_dapple.strategy.ddp_options import refuse_ddp_options
from lightning_dapple.strategy.handles import Detached, LayerTensors
from lightning_dapple.strategy.layer_rows import check_regrouped_cuts, rows_elsewhere
from lightning_dapple.strategy.loss_check import LossWatch
from lightning_dapple.strategy.hf_weights import PretrainedWeights, pretrained_weights
from lightning_dapple.strategy.meta_build import MetaBuild, built_on_meta
from lightning_dapple.strategy.module_adapter import (
    FreedLayer,
    LogRecorder,
    Logs,
    capture_call,
    capture_input,
    check_parameters_in_layers,
    combination_notice,
    combine_logged,
    find_layers,
    forward_replaced,
    key_owners,
    loss_of,
    module_home,
    replay_logs,
    state_aliases,
)
from lightning_dapple.strategy.param_groups import append_missing_groups
from lightning_dapple.strategy.part_stream import PartLane, open_part_lane, to_host
from lightning_dapple.strategy.precision import (
    DappleMixedPrecision,
    DapplePrecision,
    GlobalNormClipping,
    agree_found_inf,
    as_dapple_precision,
)
from lightning_dapple.strategy.reporting import (
    SILENT,
    OneLineLauncher,
    failure_known,
    install_excepthook,
    publish_failure,
    stop_at_failure,
    watch_for_lightning_waits,
    watch_for_peer_failures,
)
from lightning_dapple.strategy.resolve import PlanArguments, given_plan, resolve_plan, shape_with_arguments
from lightning_dapple.strategy.rng_guard import random_states, random_streams_kept, share_rank_zero_streams
from lightning_dapple.strategy.slice_transfer import StepTransfers
from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer, retie
from lightning_dapple.strategy.zero import ZeroShards



LOSS_REDUCTIONS = ("mean", "sum", "micro_batch_mean")


class _TrainCallbacks:
    """Enter the user's training_step on the first and last stages (module_adapter), with
    the fields of each slice that the step reads on the device (slice_transfer)."""

    def __init__(
        self,
        module: LightningModule,
        batch_idx: int,
        recorder: LogRecorder,
        transfers: StepTransfers,
        batch_rows: int,
        context: Callable[[], ContextManager] = nullcontext,
        scale_backward: Callable[[torch.Tensor], torch.Tensor] | None = None,
        loss_watch: LossWatch | None = None,
        traced_inputs: tuple[str, ...] | None = None,
    ) -> None:
        self.module = module
        self.traced_inputs = traced_inputs
        self.loss_watch = loss_watch  # the first step: is the loss a mean over samples (loss_check.py)
        self.batch_idx = batch_idx
        self.recorder = recorder
        self.transfers = transfers
        self.step = module.training_step
        self.batch_rows = batch_rows
        self.context = context  # autocast under mixed precision: the user's step runs inside it, as in Lightning
        self.scale_backward = scale_backward  # fp16: the loss scale, applied where the backward starts

    def make_input(self, batch: Any) -> Any:
        return self.transfers.first.run(batch, self._make_input)

    def _make_input(self, batch: Any) -> Any:
        with self.recorder.recording(self.module, 0.0), self.context():
            return capture_input(self.module, lambda: self.step(batch, self.batch_idx), self.traced_inputs)

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        weight = batch_size_of(batch) / self.batch_rows
        return self.transfers.last.run(batch, lambda on_device: self._compute_loss(on_device, forward, weight))

    def _compute_loss(self, batch: Any, forward: Callable[..., Any], weight: float) -> torch.Tensor:
        watch = self.loss_watch.watching(batch_size_of(batch), batch) if self.loss_watch is not None else nullcontext()
        if self.loss_watch is not None:
            forward = self.loss_watch.marking(forward)
        with forward_replaced(self.module, forward, self.traced_inputs), self.recorder.recording(self.module, weight), self.context(), watch:
            loss = loss_of(self.step(batch, self.batch_idx))
        if self.loss_watch is not None:
            self.loss_watch.check(loss)
        return self.scale_backward(loss) if self.scale_backward is not None else loss


class _EvalCallbacks:
    def __init__(
        self, module: LightningModule, step_name: str, args: tuple, recorder: LogRecorder, transfers: StepTransfers, traced_inputs: tuple[str, ...] | None = None
    ) -> None:
        self.module = module
        self.step_name = step_name
        self.traced_inputs = traced_inputs
        self.step = getattr(module, step_name)
        self.args = args
        self.recorder = recorder
        self.transfers = transfers
        self.keep_output = step_name == "predict_step"

    def make_input(self, batch: Any) -> Any:
        return self.transfers.first.run(batch, self._make_input)

    def _make_input(self, batch: Any) -> Any:
        with self.recorder.recording(self.module, 0.0):
            return capture_input(self.module, lambda: self.step(batch, *self.args), self.traced_inputs, self.step_name)

    def compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        return self.transfers.last.run(batch, lambda on_device: self._compute_output(on_device, forward, weight))

    def _compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        with forward_replaced(self.module, forward, self.traced_inputs, self.step_name), self.recorder.recording(self.module, weight):
            output = self.step(batch, *self.args)
        if not self.keep_output:
            return None
        return _to_cpu(output)


def _to_cpu(value: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def _combine_outputs(parts: list[Any]) -> Any:
    if parts and all(isinstance(p, torch.Tensor) and p.dim() > 0 for p in parts):
        return torch.cat(parts)
    if parts and all(isinstance(p, dict) for p in parts):
        return {key: _combine_outputs([p[key] for p in parts]) for key in parts[0]}
    if parts and all(isinstance(p, (tuple, list)) for p in parts):
        return type(parts[0])(_combine_outputs(list(items)) for items in zip(*parts))
    return parts


def _run_or_explain(call: Callable[[], Any], what: str, args: tuple, step_name: str, path: str) -> Any:
    """Run one part of the forward check; a failure becomes one line naming what broke."""
    try:
        return call()
    except Exception as exc:
        problem = f"failed on the sample batch ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if len(args) > 1:
            raise DappleConfigError(
                what,
                f"{problem}: {step_name} calls self(...) with {len(args)} positional arguments, and the pipeline hands "
                f"them to layer 0 of '{path}' as one tuple",
                f"call self(x) with layer 0's one input and use the other values in {step_name} "
                "(e.g. loss = criterion(self(inputs), target)), or make layer 0 take the tuple",
            ) from None
        raise DappleConfigError(
            what, problem, f"make forward(x) apply the layers of '{path}' in order, each taking what the previous one returned"
        ) from None


def _output_leaves(value: Any) -> list[Any]:
    """The values in a forward output, in order, through tuples, lists, mappings (a Hugging
    Face ``ModelOutput`` is an OrderedDict) and dataclasses, which pytree leaves whole. A
    Hugging Face key/value cache (``past_key_values`` when ``config.use_cache``) is state for
    generation, not a value the step trains on; the pipeline's layers keep none."""
    if type(value).__module__.startswith("transformers.cache_utils"):
        return []
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _output_leaves(item)]
    if isinstance(value, Mapping):
        return [leaf for key in value for leaf in _output_leaves(value[key])]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for field in dataclasses.fields(value) for leaf in _output_leaves(getattr(value, field.name))]
    return [value]


def _check_callbacks(trainer: Trainer, plan: Plan) -> None:
    """Callbacks that need the whole model on every rank: ``StochasticWeightAveraging`` copies
    the module when it is set up, before the stages are freed, and then pairs the copy's
    parameters with ``self.parameters()``, which on a pipeline are one stage's."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if plan.num_stages > 1 and any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):
        raise DappleConfigError(
            "StochasticWeightAveraging",
            f"averages a copy of the whole model, but on this {plan.num_stages}-stage plan each rank's module holds one "
            "stage's parameters",
            "train on a single-stage plan (data parallelism) with it, or average the weights after training "
            "(torch.optim.swa_utils.AveragedModel over the checkpoints rank 0 writes)",
        )


def _check_module(module: LightningModule) -> None:
    """What the pipeline cannot run as the module asks, refused before anything is set up."""
    require(
        module.automatic_optimization,
        "automatic_optimization",
        "is off; manual optimization is not supported by the pipeline",
        "use automatic optimization (the default)",
    )
    require(
        not is_overridden("backward", module),
        f"{type(module).__name__}.backward",
        "is overridden, but the pipeline runs every micro-batch's backward itself, inside the step, so it would never run",
        "put what it does into the loss training_step returns (a scale, an extra term), or into on_after_backward",
    )
    require(
        getattr(module, "_compiler_ctx", None) is None,
        "the model",
        "was compiled whole (trainer.fit(torch.compile(model))): Lightning then runs forward and every step as compiled "
        "programs, but the pipeline runs the step's forward as stages on several processes, which one compiled program "
        "cannot span",
        "compile the blocks instead, e.g. `for i, block in enumerate(self.blocks): self.blocks[i] = torch.compile(block)` "
        "in __init__ or configure_model, and pass the LightningModule itself to fit",
    )


def _check_rates_kept(optimizers: Sequence[Any], before: list[Any]) -> None:
    """The step left every learning rate as it found it (``_learning_rates`` before it)."""
    require(
        _learning_rates(optimizers) == before,
        "training_step",
        "changes a learning rate (a scheduler's step(), or param_groups[...]['lr'] set in the step), but the step runs "
        "once per micro-batch, and past self(...) only on the last stage's ranks: the stages would train at other rates",
        "step the scheduler from configure_optimizers (interval='step'), or in on_train_batch_start / on_train_batch_end, "
        "which run once per batch on every rank",
    )


def _learning_rates(optimizers: Sequence[Any]) -> list[Any]:
    """Every group's learning rate; a tensor one by its in-place version (no device read)."""
    return [
        (id(lr), lr._version) if isinstance(lr, torch.Tensor) else lr
        for optimizer in optimizers
        for lr in (group.get("lr") for group in optimizer.param_groups)
    ]


def _grads_zeroed_after_step(trainer: Trainer, batch_idx: int, params: Sequence[torch.Tensor], stepped: set[int]) -> bool:
    """Whether Lightning's automatic optimization sets every one of ``params``' gradients to
    None right after this training step, before anything can read them: the first batch of
    an accumulation window, the default ``optimizer_zero_grad``, no ``on_before_zero_grad``
    hook (which would read the previous step's gradients), every parameter in an optimizer."""
    module = trainer.lightning_module
    if batch_idx % trainer.accumulate_grad_batches or is_overridden("optimizer_zero_grad", module):
        return False
    if is_overridden("on_before_zero_grad", module) or any(
        is_overridden("on_before_zero_grad", callback, parent=Callback) for callback in trainer.callbacks
    ):
        return False
    return all(id(p) in stepped for p in params)


def _value_dtype(module: LightningModule) -> torch.dtype:
    """The dtype the step's loss and logged values reach Lightning in: the module's
    parameters' (frozen ones count: a stage may train none), as one device's would be."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), module.dtype)


def _step_name(trainer: Trainer) -> str:
    """The step function the Trainer runs now (it calls ``self(...)``); a Trainer not
    running yet is taken to fit."""
    return {
        TrainerFn.VALIDATING: "validation_step",
        TrainerFn.TESTING: "test_step",
        TrainerFn.PREDICTING: "predict_step",
    }.get(trainer.state.fn, "training_step")


def _forward_args(module: LightningModule, batch: Any, step_name: str) -> tuple:
    """The positional arguments the step passes to ``self(...)`` for ``batch``."""
    with LogRecorder().recording(module, 0.0):
        return capture_call(module, lambda: getattr(module, step_name)(batch, 0))


def _merge_logs(per_replica: list[Logs | None]) -> Logs:
    merged: Logs = {}
    for logs in per_replica:
        for name, (total, weight, kwargs) in (logs or {}).items():
            if name in merged:
                merged[name] = (*combine_logged(merged[name][:2], (total, weight), kwargs), kwargs)
            else:
                merged[name] = (total, weight, kwargs)
    return merged


class DappleStrategy(DDPStrategy):
    """Hybrid pipeline/data-parallel training (DAPPLE) behind ``Trainer(strategy=...)``.

    Args:
        plan: ``"auto"`` (profile and plan on the first fit), a plan JSON path, a Plan or
            its dict. A hand-written plan needs only global_batch_size, micro_batches and
            each stage's layers and devices; stages with devices and no layers are a shape
            (``PlanShape``) whose layer cut the planner chooses.
        micro_batches, schedule, policy: override the plan's M, schedule ("dapple",
            "gpipe", "interleaved", "zbv") and K_i policy ("PA", "PB"); a policy left out
            (or "auto") is the plan's, which under plan="auto" is the one the plan
            simulates faster with (``plan/policy_choice.py``); a schedule left out (or
            "auto") is the plan's, which under plan="auto" is the fastest simulated one
            that fits (``plan/schedule_choice.py``, among ``RUNNABLE_SCHEDULES``).
        cluster: a cluster preset/file/Cluster for auto planning; default: this machine
            as detected (``cluster.detect_cluster``: the Trainer's nodes x devices, the
            GPUs' name and memory, or the host's memory per CPU process).
        layers: attribute path of the module's layer sequence; ``"auto"``, or a module
            without the default ``layers``, gets the layer list traced from ``forward``
            (``profile/traced_layers.py``), printed at setup.
        loss_reduction: "mean" (the loss is a mean over samples; the first training step
            refuses a mean over targets such as ``cross_entropy`` with ignored labels,
            ``strategy/loss_check.py``), "sum", or "micro_batch_mean" (each micro-batch's
            loss weighted by its share of rows, unchecked: what other pipeline engines do).
        timeout_s: bound on every wait between ranks that both take part (transfers,
            gradient AllReduces); waits for one rank's own work (rank 0 planning, writing a
            checkpoint) last as long as it lives (``execute/store_sync.py``). A failure on
            one rank stops all ranks.
        profile_cache: directory for cached layer profiles.
        ooo: out-of-order backprop (weight gradients deferred into idle time): True, False
            or "auto" (on where the simulator says it helps this plan, see
            ``strategy/ooo_choice.py``; the choice and its reason are in the plan JSON).
        recompute: "never", "always", "except_last", one mode per stage, or "auto"
            (chosen by the memory model under plan="auto").
        wire: how stage boundaries travel (``execute/wires.py``): "auto" (gloo for CPU
            tensors, pinned host staging for CUDA tensors over gloo, a communicator per
            link and direction under NCCL), or one of them forced.
        kwargs: Lightning's ``accelerator``, ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin`` and ``process_group_backend``. Options
            of DDP's wrapper (``find_unused_parameters``, ``ddp_comm_hook``, ...) are
            refused with what the strategy does instead (``ddp_options.py``).
        deferred_batchnorm: BatchNorm running statistics updated once per step from the
            whole global batch, each micro-batch still normalised with its own statistics
            (torchgpipe's DeferredBatchNorm, GPipe 2.2; ``execute/batchnorm.py``). Off, they
            move once per micro-batch slice. ``Trainer(sync_batchnorm=True)`` normalises each
            micro-batch over all replicas of its stage.
        zero: 1 shards a replicated stage's optimizer state over its replicas (ZeRO-1,
            ``zero.py``): each keeps its share's state, steps it, and sends the parameters it
            stepped to the others; 2 also reduces each gradient to its owner only (ZeRO-2),
            so each replica keeps its share of the gradients; 0 (default) keeps the whole
            state on every replica, unless the plan's stages say otherwise; "auto" lets
            plan="auto" choose per stage (``plan/zero_choice.py``) and keeps a given plan's.
        meta_init: build a model made in ``configure_model`` on the meta device and make only
            this rank's stage, with the values of the whole model built on the CPU
            (``meta_build.py``); off, every rank builds the whole model on the CPU first.
            ``Trainer.init_module(empty_init=True)`` builds on the meta device the same way.
        pretrained: a ``save_pretrained`` directory whose weights the Hugging Face model
            built on the meta device takes (``{attribute path: directory}`` for several):
            each rank reads only its stage's tensors (``hf_weights.py``).
        checkpoint: "consolidated" (one file, gathered on rank 0 from the stage leaders,
            ``checkpoint.py``) or "sharded" (a directory: each stage leader writes its own
            stage through ``torch.distributed.checkpoint``, rank 0 the rest in ``meta.pt``;
            no rank gathers the model, ``sharded_checkpoint.py``). Either resumes under
            any plan; ``Trainer.fit(ckpt_path=...)`` reads both.
        gather_after_fit: whether rank 0 gets the whole trained model back after ``fit``
            (gathered from the stages, as plain training leaves it); default: yes under
            "consolidated", no under "sharded" (rank 0 then keeps its own stage only).
    """

    strategy_name = "dapple"
    _weights: PretrainedWeights | None = None  # DappleStrategy(pretrained)'s directories, until this rank's stage is made

    def __init__(
        self,
        plan: Any = "auto",
        micro_batches: int | None = None,
        schedule: str | None = None,
        policy: str | None = None,
        cluster: Any = None,
        layers: str = "layers",
        loss_reduction: Literal["mean", "sum", "micro_batch_mean"] = "mean",
        timeout_s: float = 120.0,
        profile_cache: str | None = None,
        ooo: bool | str = "auto",
        recompute: Any = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        wire: str = "auto",
        deferred_batchnorm: bool = False,
        meta_init: bool = True,
        pretrained: Any = None,
        zero: int | str = 0,
        checkpoint: Literal["consolidated", "sharded"] = "consolidated",
        gather_after_fit: bool | None = None,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        refuse_ddp_options(kwargs)  # raises for a DDP option set to anything but its default; drops the rest
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, start_method=start_method, timeout=timedelta(seconds=timeout_s),
        )
        require(loss_reduction in LOSS_REDUCTIONS, "loss_reduction", f"is {loss_reduction!r}", "use 'mean', 'sum' or 'micro_batch_mean'")
        self.plan_arguments = PlanArguments(micro_batches, schedule, policy, recompute, ooo, zero)
        require(
            recompute != "auto" or plan == "auto",
            "recompute",
            "is 'auto' but the plan is given explicitly; 'auto' needs the profile that plan='auto' measures",
            "use plan='auto', or name a mode per stage (never/always/except_last)",
        )
        require(wire in WIRES, "wire", f"is {wire!r}", f"use one of {', '.join(WIRES)}")
        self.wire = wire
        self.deferred_batchnorm = deferred_batchnorm
        self.meta_init, self.pretrained = meta_init, pretrained
        require(zero in (0, 1, 2, "auto"), "zero", f"is {zero!r}", "use 'auto' (the planner chooses per stage), 0 (every replica keeps the whole optimizer state), 1 (ZeRO-1: each keeps its share) or 2 (ZeRO-2: also its share of the gradients)")
        self.zero = zero
        self._zero: ZeroShards | None = None  # this rank's share of a replicated stage's optimizer state (zero.py)
        self._meta_build: MetaBuild | None = None  # configure_model's record, until this rank's stage is made
        require(checkpoint in sharded.MODES, "checkpoint", f"is {checkpoint!r}", "use 'consolidated' or 'sharded'")
        self.checkpoint_mode = checkpoint
        self.gather_after_fit = checkpoint == "consolidated" if gather_after_fit is None else bool(gather_after_fit)
        self.plan_spec = plan
        self.cluster_spec = cluster
        self.layers_path = layers
        self.loss_reduction = loss_reduction
        self.timeout_s = timeout_s
        self.profile_cache = profile_cache
        self.plan: Plan | None = None
        self._hidden_example: Any = None  # the module's example_input_array while the Trainer runs (_hide_example_input)
        self.runner: StageRunner | ChunkedRunner | None = None
        self.failure: FailureChannel | None = None
        self._sync: StoreSync | None = None  # Lightning's barriers and broadcasts, once the channel exists
        self._loss_checked = False  # the first training step watches the loss (loss_check.py)
        self._noticed_logs: set[str] = set()  # logged names already judged by combination_notice
        self._traced_inputs: tuple[str, ...] | None = None  # forward's parameters a traced layer list takes
        self._rows_elsewhere: dict[int, str] = {}  # layers whose outputs hold rows elsewhere than dim 0 (layer_rows.py)
        self.groups: PlanGroups | None = None
        self._layer_container: nn.Module | None = None
        self.checkpoint_layout: ckpt.CheckpointLayout | None = None
        self._part_lane: PartLane | None = None  # opened at the first save
        self._freed: dict[int, nn.Module] = {}
        self._ties: tuple[TiedParameter, ...] = ()  # parameters several layers use (profile/ties.py)
        self._layer_tensors: LayerTensors | None = None  # what each layer holds, by identity (handles.py)
        self._detached = Detached()  # the other paths to freed layers emptied on this rank
        self._planning_inputs: PlanningInputs | None = None  # rank 0 after plan="auto"
        self._saved_grads: list[torch.Tensor | None] | None = None
        self._transfers: dict[str, StepTransfers] = {}  # per step function: what its slices move
        self._stages_move_slices = True  # False: the module's own transfer hooks move whole batches

    # -- set-up ------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else DapplePrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning's plugins become their pipeline forms (global-norm clipping, agreed fp16 steps)
        self._precision_plugin = as_dapple_precision(plugin)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Modules made in ``configure_model`` are made on the meta device and recorded
        (``meta_build.py``): the plan is not known yet, and the whole model may not fit one
        process. Each rank materializes only its stage's layers in ``setup``, with the values
        the whole model built on the CPU would have. ``Trainer.init_module(empty_init=True)``
        (before the run starts: what Lightning asks for a model too large to initialise
        whole, which FSDP makes on the meta device too) records the same way; the module is
        known at ``connect``. With ``meta_init=False``, and under ``Trainer.init_module()``
        without ``empty_init=True``, they are made on the CPU as before."""
        if not self.meta_init or (self.lightning_module is None and not empty_init):
            with self.precision_plugin.tensor_init_context():
                yield
            return
        build = self._meta_build if self._meta_build is not None else MetaBuild()  # configure_model adds to init_module's
        with self.precision_plugin.tensor_init_context(), build.recording():
            yield
        self._meta_build = build
        if self.lightning_module is not None:
            build.finish(self.lightning_module)

    @override
    def connect(self, model: LightningModule) -> None:
        """A module built under ``Trainer.init_module(empty_init=True)`` is named to its
        record here, before any conversion replaces its buffers (``meta_build.py``)."""
        super().connect(model)
        if self._meta_build is not None:
            self._meta_build.finish(model)

    @override
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank iterates the same global batches: one sampler replica for all."""
        return {"num_replicas": 1, "rank": 0}

    @property
    def stages(self) -> tuple[int, ...]:
        """The stages this rank runs: one, or its device group's chunks (interleaved, V)."""
        assert self.plan is not None
        return self.plan.stages_of_rank(self.global_rank)

    @property
    def held_layers(self) -> list[int]:
        """The layers of this rank's stages, in pipeline order (the runner's layer list)."""
        assert self.plan is not None
        return [index for stage in self.stages for index in range(self.plan.stages[stage].start, self.plan.stages[stage].end)]

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):  # a rank's failure arrives as one line
            self._launcher = OneLineLauncher(self, start_method=self._start_method)
        install_excepthook(None)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load a checkpoint into the stage-local module after ``setup`` has converted it
        (e.g. to float64 under 64-true): loading first would round the weights through the
        module's original dtype."""
        return True

    @override
    def on_train_start(self) -> None:
        """A resumed fit continues the dropout seeds where the checkpointed run left them
        (they include the number of training steps run, ``runner.steps_done``)."""
        super().on_train_start()
        if self.runner is not None:
            trainer = self.lightning_module.trainer
            self.runner.steps_done = trainer.global_step * trainer.accumulate_grad_batches

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before an epoch's first step, every rank's optimizer gets the parameter groups
        another rank added (``param_groups.py``: a fine-tuning callback's backbone group)."""
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx == 0 and self.world_size > 1 and self._sync is not None and self.optimizers:
            sync = self._sync
            append_missing_groups(self.optimizers, lambda settings: sync.gather(settings, "the optimizers' parameter groups"))

    @override
    def setup_distributed(self) -> None:
        """Lightning's DDP set-up, except that a gloo default group binds no device. Bound to
        a GPU (``init_process_group(device_id=...)``, which DDP passes for CUDA), torch makes
        every later ``new_group`` split from the default group, and a gloo group cannot split
        for the ranks left out of the new group (torch 2.11: no ``perform_nocolor_split``):
        ranks sharing one GPU over the staged wire would fail at their first replica group.
        Under NCCL the binding stays (eager communicators, split from the default one).

        Every rank then takes rank 0's random streams as the script left them, instead of
        DDP's re-seeding, so that every rank draws the shuffle plain Lightning would draw in
        the user's process (``rng_guard.py``)."""
        script_streams = random_states()
        if self._get_process_group_backend() != "gloo":
            super().setup_distributed()
        else:
            self.set_world_ranks()
            self._process_group_backend = "gloo"
            assert self.cluster_environment is not None
            _init_dist_connection(self.cluster_environment, "gloo", timeout=self._timeout)
        if dist.is_initialized() and dist.get_world_size() > 1:
            share_rank_zero_streams(dist.distributed_c10d._get_default_store(), self.global_rank, script_streams)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # gloo groups left to the interpreter's finalization can abort a finished run (shutdown.py)
        destroy_groups_at_exit(self)
        # an uncaught error prints one line, once (reporting.py; DAPPLE_DEBUG=1: tracebacks)
        install_excepthook(self.global_rank if self._start_method == "popen" else SILENT)
        watch_for_peer_failures(self.global_rank)  # a peer's failure in Lightning's own hooks, before setup: it speaks
        choose_wire(self.wire, self.root_device)  # a forced wire this backend cannot run fails before training

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A failure anywhere in the Trainer's run (a callback, a hook between steps) is
        published before the teardown closes this rank's connections (``reporting.py``)."""
        super().on_exception(exception)
        publish_failure(self, exception)

    def exit_failed(self) -> bool:
        """Whether this rank has seen a failure (then the exit handler leaves the groups alone):
        in training (the failure channel) or before it (``reporting.failure_known``)."""
        return (self.failure is not None and self.failure.known_failed) or failure_known()

    def release_groups(self) -> None:
        """Drop this strategy's references to process groups (so that destroying them at
        exit joins their threads; shutdown.py)."""
        self.runner = None
        self.groups = None
        self._part_lane = None

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        # Every rank iterates the user's DataLoader unchanged: the same global batches in
        # the order one device would see them (Lightning would otherwise inject a
        # shuffling DistributedSampler that shards the data per rank).
        trainer._accelerator_connector.use_distributed_sampler = False
        self._check_precision()
        module = self.lightning_module
        assert module is not None
        _check_module(module)
        self.precision_plugin.convert_module(module)
        if self.plan is None:
            with random_streams_kept():  # the first epoch's shuffle and draws are plain Lightning's
                self._prepare_pipeline(trainer, module)
        self._hide_example_input(module)
        # only now, with the other stages' layers freed, does anything move to the device
        self.model_to_device()
        mixed = self._mixed()
        if mixed is not None and mixed.scaler is not None:
            mixed.scaler.scale(torch.ones((), device=self.root_device))  # the scale lives on this device
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_local_optimizers(trainer)
            self._shard_optimizer_state()
            if mixed is not None:
                mixed.check_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._connect_precision()
        # the module's own transfer hooks define what a batch on the device is: they then
        # move whole batches, as in Lightning (see batch_to_device)
        self._stages_move_slices = not any(is_overridden(hook, module) for hook in ("transfer_batch_to_device", "on_after_batch_transfer"))
        watch_for_lightning_waits(trainer)  # Lightning's per-batch SIGTERM broadcast, by the failure channel (reporting.py)

    def _stepped_parameters(self) -> set[int]:
        """The parameters the optimizers step (by id), ZeRO-1's other shares included: the
        gradients Lightning's ``zero_grad`` (or the share exchange) clears after a step."""
        params = [p for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]]
        return {id(p) for p in (self._zero.complete(params) if self._zero is not None else params)}

    def _shard_optimizer_state(self) -> None:
        """Under ``zero=1`` on a replicated stage, keep only this replica's share of the
        optimizer state (``zero.py``), before the optimizers make any."""
        self._zero = None
        assert self.plan is not None and self.failure is not None
        stage = self.plan.stages[self.stages[0]]
        if not stage.zero or stage.replicas == 1 or self.groups is None:  # the plan's level (resolve.py sets the user's)
            return
        self._zero = ZeroShards(stage.devices, self.global_rank, self.groups.replicas[self.stages[0]], self.failure.wait, level=stage.zero)
        self._zero.shard(self.optimizers)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; under ZeRO-1 the replicas then exchange what each stepped."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._zero is not None:
            self._zero.share(optimizer)
        return output

    def _setup_local_optimizers(self, trainer: Trainer) -> None:
        """``configure_optimizers`` on this rank's parameters. A stage holding only frozen
        layers (a frozen backbone's first layers) gives an optimizer built from the trained
        parameters nothing, which torch refuses; say which stage and what to do."""
        try:
            self.setup_optimizers(trainer)
        except ValueError as exc:
            if self.runner is None or self.runner.parameters or self.plan is None:
                raise
            held = [f"stage {index} (layers [{self.plan.stages[index].layers[0]}, {self.plan.stages[index].layers[1]}))" for index in self.plan.stages_of_rank(self.global_rank)]
            raise DappleConfigError(
                "configure_optimizers",
                f"failed on rank {self.global_rank} ({exc}): its {', '.join(held)} holds no trained parameter (every layer there is "
                "frozen), so an optimizer over the trained parameters it sees gets none",
                "give every stage a trained layer (a plan whose first stage also holds the first trained layers); where nothing "
                "unfreezes them later (BackboneFinetuning adds them as a group of their own), the optimizer may also be built "
                "from self.parameters() (frozen ones get no gradient, so they stay as they are)",
            ) from None

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        require(
            isinstance(plugin, GlobalNormClipping),
            "Trainer(precision)",
            f"uses {type(plugin).__name__}, which the dapple strategy does not support",
            "use precision='32-true', '64-true', 'bf16-true', '16-true', 'bf16-mixed' or '16-mixed'",
        )

    def _mixed(self) -> DappleMixedPrecision | None:
        plugin = self.precision_plugin
        return plugin if isinstance(plugin, DappleMixedPrecision) else None

    def _forward_context(self) -> Callable[[], ContextManager] | None:
        """What the executor enters around every stage forward and recomputation: autocast
        under mixed precision (the same dtype in the replayed forward as in the first)."""
        mixed = self._mixed()
        return mixed.forward_context if mixed is not None else None

    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast computes in under mixed precision (None otherwise)."""
        mixed = self._mixed()
        if mixed is None:
            return None
        return torch.bfloat16 if mixed.precision == "bf16-mixed" else torch.float16

    def _connect_precision(self) -> None:
        """Hand the precision plugin the pipeline's collectives (precision.py): the global
        gradient norm for clipping and, under fp16, the agreed inf/nan check."""
        plugin = self.precision_plugin
        assert isinstance(plugin, GlobalNormClipping)
        plugin.clip_norm = self._clip_by_global_norm
        mixed = self._mixed()
        if mixed is not None:
            mixed.agree = self._agree_found_inf

    def _clip_by_global_norm(self, params: list[torch.Tensor], max_norm: float) -> None:
        assert self.plan is not None
        if self._zero is not None:  # the norm is over the stage's gradients, not this replica's share
            params = self._zero.complete(params)
        replicas = self.plan.stages[self.stages[0]].replicas  # the rank's chunks share their devices
        group = self.groups.plan if self.groups else None
        tied = self.runner.tied if self.runner is not None else None  # tied copies count once
        copies = tied.copies if tied is not None else None
        shares = self._zero.shares if self._zero is not None else None  # each owner counts its share
        clip_grad_norm_global(params, max_norm, replicas, self.failure, group=group, device=self.root_device, copies=copies, shares=shares)

    def _agree_found_inf(self, scaler: Any, optimizer: Any) -> torch.Tensor:
        """fp16: every rank of the plan skips or takes the step together (precision.py)."""
        assert self.failure is not None
        group = self.groups.plan if self.groups else None
        return agree_found_inf(scaler, optimizer, self.root_device, group=group, wait=self.failure.wait)

    def _prepare_pipeline(self, trainer: Trainer, module: LightningModule) -> None:
        """Check the module, resolve the plan and keep only this rank's stage.

        Placement: everything here runs where the module already lives (normally the CPU):
        the sample batch stays there, the forward check runs there and the profiler moves
        one layer at a time to the device. The other stages' layers are freed (moved to the
        meta device, structure kept) before ``setup`` moves anything to this rank's device,
        so the whole model never has to fit on one device (DAPPLE 4: stages exist because
        it need not).
        """
        self._weights = pretrained_weights(module, self.pretrained, built_on_meta(module))  # headers only, every rank
        if self._meta_build is not None:  # a build on the meta device that cannot be replayed stops here
            self._meta_build.check(type(module).__name__, self._weights.loads if self._weights is not None else lambda name: False)
        sample = self._sample_batch(trainer, module)
        container = self._find_layers(trainer, module, sample)
        self._traced_inputs = container.inputs if isinstance(container, TracedLayers) else None
        check_parameters_in_layers(module, container, self.layers_path)
        self._check_forward_is_layers(module, container, sample, trainer)
        self._close_runner()
        # before planning: the other ranks wait for rank 0's plan for as long as it lives
        self.failure = FailureChannel(self.global_rank, timeout_s=self.timeout_s)
        stop_at_failure(self.failure)
        self._sync = StoreSync(self.failure)
        plan = self._resolve_plan(trainer, module, container, sample)
        plan = plan.validate(num_layers=len(container), world_size=self.world_size).with_warmups()
        check_regrouped_cuts(plan, self._rows_elsewhere)
        _check_callbacks(trainer, plan)
        self.plan = plan
        self._save_plan(trainer)
        report_placement(self.cluster_environment, self.num_nodes, self.num_processes, plan)  # every rank: the launch's nodes agree with the plan; rank 0 prints them
        held = self.held_layers
        self._make_stage(module, container, held)
        self._ties = tied_parameters(container)
        aliases = state_aliases(module, container)
        self.checkpoint_layout = ckpt.CheckpointLayout(
            key_owner=key_owners(module, container),
            parameter_names=[aliases.get(name, name) for name, _ in module.named_parameters()],
            stage_leaders=tuple(each.devices[0] for each in plan.stages),
            global_rank=self.global_rank,
            aliases=aliases,
            layers=tuple((plan.stages[s].start, plan.stages[s].end) for s in self.stages),
            optimizer_ranks=tuple(sorted({rank for each in plan.stages for rank in (each.devices if each.zero and each.replicas > 1 else each.devices[:1])})),
        )
        self._layer_tensors = LayerTensors.of(module, container, keep_transient=self.global_rank == 0)
        # handles and traced layers' own paths first, while every tensor is still the original
        self._detached = self._layer_tensors.detach(module, container, held, self._stage_of_layer)
        upstream_draws = draws_random(container[i] for i in range(plan.stages[-1].start))  # before they are freed
        self._free_other_stages(container, held)
        self._layer_container = container
        self.groups = build_groups(plan)  # a collective; BatchNorm's statistics use the replica groups
        for stage in self.stages:
            self._convert_batchnorm(module, container, stage)
        local = [container[i] for i in held]
        self.runner = StageRunner.for_plan(  # collectives: every rank makes every group
            plan,
            self.global_rank,
            local,
            self.root_device,
            self.failure,
            groups=self.groups,
            ties=self._ties,
            loss_reduction="sum" if self.loss_reduction == "sum" else "mean",  # the executor weights rows or not
            forward_context=self._forward_context(),
            wire=self.wire,
        )
        for unit in getattr(self.runner, "units", [self.runner]):
            unit.pipeline_stage.upstream_draws = upstream_draws and unit.is_last and not unit.is_first
        # rank 0's seed on every rank: a step's random draws before self(...) (noise, masks)
        # are then the same on the first stage and the last (execute/stage.py)
        self.runner.job_seed = self._sync.broadcast(torch.initial_seed(), "the job's seed") if self.world_size > 1 else torch.initial_seed()

    def _convert_batchnorm(self, module: LightningModule, container: nn.Module, index: int) -> None:
        """This stage's BatchNorm as asked (``execute/batchnorm.py``): statistics over the
        stage's replicas under ``Trainer(sync_batchnorm=True)`` (Lightning's DDP converts to
        ``nn.SyncBatchNorm`` instead, which would synchronise over the whole job and refuses
        CPU tensors), running statistics once per step under ``deferred_batchnorm``."""
        layer_sync = self._layer_sync
        require(
            layer_sync is None or isinstance(layer_sync, TorchSyncBatchNorm),
            "Trainer(plugins)",
            f"include a {type(layer_sync).__name__} layer-sync plugin, which the dapple strategy cannot apply per pipeline stage",
            "use Trainer(sync_batchnorm=True) (BatchNorm statistics over each stage's replicas) or leave the plugin out",
        )
        assert self.groups is not None and self.plan is not None
        stage = self.plan.stages[index]
        scope = [container[i] for i in range(stage.start, stage.end)]
        replica = stage.devices.index(self.global_rank)
        sync = layer_sync is not None
        convert_batchnorm(module, scope, self.groups.replicas.get(index), replica, stage.replicas, sync, self.deferred_batchnorm)

    def _make_stage(self, module: LightningModule, container: nn.Module, held: Sequence[int]) -> None:
        """A model built on the meta device (``configure_model``) gets real tensors for this
        rank's layers and for what lies outside the layer list, replayed from the build's
        record (``meta_build.py``); the other stages' layers stay on the meta device."""
        build, self._meta_build = self._meta_build, None
        if build is None or not built_on_meta(module):
            return
        holders: dict[int, set[int]] = {}
        for index, layer in enumerate(container):
            for tensor in (*layer.parameters(), *layer.buffers()):
                holders.setdefault(id(tensor), set()).add(index)
        mine = set(held)
        transient: set[int] = set()
        if self.global_rank == 0 and self.gather_after_fit:  # rank 0 rebuilds every layer after fit; buffers outside the state come from here
            saved = {id(tensor) for tensor in module.state_dict(keep_vars=True).values()}
            transient = {id(buffer) for buffer in module.buffers() if id(buffer) not in saved}
        owned = lambda tensor: id(tensor) not in holders or bool(holders[id(tensor)] & mine) or id(tensor) in transient  # noqa: E731
        build.materialize(module, owned, self._weights)
        if self._weights is not None:
            self._weights.close()
            self._weights = None

    def _free_other_stages(self, container: nn.Module, held: Sequence[int]) -> None:
        """Free every layer but ``held`` (this rank's) to the meta device (structure kept,
        memory released); what a kept layer shares with a freed one (a tied weight) stays real."""
        kept = KeptTensors(container[i] for i in held)
        mine = set(held)
        for index in range(len(container)):
            if index not in mine:
                self._freed[index] = free_layer(container[index], kept)
                container[index] = FreedLayer(index, self._stage_of_layer(index))

    def _stage_of_layer(self, index: int) -> int:
        assert self.plan is not None
        for number, stage in enumerate(self.plan.stages):
            if stage.start <= index < stage.end:
                return number
        raise IndexError(index)

    def _sample_batch(self, trainer: Trainer, module: LightningModule) -> Any:
        loop = {
            TrainerFn.FITTING: trainer.fit_loop,
            TrainerFn.VALIDATING: trainer.validate_loop,
            TrainerFn.TESTING: trainer.test_loop,
            TrainerFn.PREDICTING: trainer.predict_loop,
        }[trainer.state.fn]
        loader = _request_dataloader(loop._data_source)
        if isinstance(loader, (list, tuple)):
            loader = loader[0]
        try:
            batch = next(iter(loader))
        except StopIteration:
            raise DappleConfigError("dataloader", "is empty", "give the Trainer a dataloader with at least one batch") from None
        # Where the module lives (not yet this rank's device: nothing is there before the
        # other stages are freed), through the user's transfer hooks, and converted as the
        # loops do before a step (e.g. 64-true turns float inputs into float64).
        home = module_home(module)  # a model built on the meta device computes on the CPU once its layers are made
        return self.precision_plugin.convert_input(self.batch_to_device(batch, device=torch.device("cpu") if home.type == "meta" else home))

    def _find_layers(self, trainer: Trainer, module: LightningModule, batch: Any) -> nn.Module:
        """The layer sequence at ``layers``, or the layer list traced from ``forward``
        (``layers="auto"``, or a module without the default ``layers``): traced on the
        arguments ``self(...)`` gets for one and two rows of the sample batch, and printed."""
        step_name = _step_name(trainer)

        def samples() -> list[tuple]:
            counts = sorted({1, min(2, batch_size_of(batch))})
            return [_forward_args(module, take_rows(batch, 0, count), step_name) for count in counts]

        container = find_layers(module, self.layers_path, samples)
        if isinstance(container, TracedLayers):
            for line in container.describe():
                rank_zero_info(line)
        return container

    def _check_forward_is_layers(self, module: LightningModule, container: nn.Module, batch: Any, trainer: Trainer) -> None:
        """DAPPLE executes the layer list; a forward that does more would silently differ.

        Runs on two sample rows where the module lives (normally the CPU, never the whole
        model on this rank's device), without autograd, autocast or RNG side effects; the
        layers run on one row too, to find outputs that hold the rows elsewhere than in
        their first dimension (``layer_rows.py``).
        """
        if built_on_meta(module) and is_hf_layer_list(container):
            return  # Hugging Face's mask code reads values, which the meta device has none of; the list is its own forward cut at its blocks
        if built_on_meta(module):  # shapes only: the sample goes where the layers are
            batch = move_data_to_device(batch, torch.device("meta"))
        step_name = _step_name(trainer)
        rows = min(2, batch_size_of(batch))
        args = _forward_args(module, take_rows(batch, 0, rows), step_name)
        state = torch.random.get_rng_state()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                expected = _run_or_explain(lambda: module(*args), f"{type(module).__name__}.forward", args, step_name, self.layers_path)
                outputs = self._layer_outputs(container, args, step_name)
                actual = outputs[-1]
                self._rows_elsewhere = {}
                if rows == 2:
                    one = self._layer_outputs(container, _forward_args(module, take_rows(batch, 0, 1), step_name), step_name)
                    self._rows_elsewhere = rows_elsewhere([one, outputs], [1, 2])
        finally:
            module.train(was_training)
            torch.random.set_rng_state(state)
        left, right = _output_leaves(expected), _output_leaves(actual)
        same = len(left) == len(right) and all(
            (a.shape == b.shape and (a.is_meta or b.is_meta or torch.allclose(a, b, atol=1e-5, rtol=1e-4)))
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            else (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
            for a, b in zip(left, right)
        )
        if isinstance(container, TracedLayers):
            require(
                same,
                f"{type(module).__name__}.forward",
                "computes other values than the layer list traced from it, on a sample batch",
                "give the layer list by hand: an nn.Sequential that forward applies in order, passed as DappleStrategy(layers='...')",
            )
        require(
            same,
            f"{type(module).__name__}.forward",
            f"does not equal applying '{self.layers_path}' in order on a sample batch",
            f"make forward(x) apply only the layers of '{self.layers_path}' in order (move pre/post-processing into a layer or into the step), "
            "or pass DappleStrategy(layers='auto') to trace the layer list, glue included, from forward",
        )

    def _layer_outputs(self, container: nn.Module, args: tuple, step_name: str) -> list[Any]:
        """Each layer's output, the layers applied in order to what ``self(*args)`` passes."""
        outputs, value = [], args[0] if len(args) == 1 else args
        for index, layer in enumerate(container):
            value = _run_or_explain(lambda: layer(value), f"{self.layers_path}[{index}] ({type(layer).__name__})", args, step_name, self.layers_path)
            outputs.append(value)
        return outputs

    def planning_context(self, trainer: Trainer) -> PlanningContext:
        """What ``plan="auto"`` needs to know about this run (``strategy/auto_plan.py``).

        The cluster is the one given to the strategy, or this machine as the Trainer uses
        it (nodes x processes per node, ``cluster.detect_cluster``), whose AllReduce is then
        measured before planning."""
        if self.cluster_spec is not None:
            cluster = load_cluster(self.cluster_spec)
        else:
            accelerator = "gpu" if self.root_device.type == "cuda" else "cpu"
            cluster = detect_cluster(max(1, self.num_nodes), max(1, self.num_processes), accelerator)
        return PlanningContext(
            arguments=self.plan_arguments,
            cluster=cluster,
            device=self.root_device,
            world_size=self.world_size,
            global_rank=self.global_rank,
            directory=Path(trainer.log_dir or trainer.default_root_dir),  # a collective: every rank asks
            resuming=bool(trainer.ckpt_path),
            profile_cache=self.profile_cache,
            autocast_dtype=self.autocast_dtype(),
            local_processes=max(1, self.num_processes),
            measure_links=self.cluster_spec is None,
            step_name=_step_name(trainer),
        )

    def _resolve_plan(self, trainer: Trainer, module: LightningModule, container: nn.Module, sample: Any) -> Plan:
        spec = self.plan_spec
        given = given_plan(None if isinstance(spec, (str, Path)) and str(spec) == "auto" else spec, self.plan_arguments)
        if isinstance(given, Plan):
            plan = given
        else:  # "auto", or a shape whose layer cut the planner chooses
            shape = shape_with_arguments(given, self.plan_arguments) if given is not None else None
            # built on the meta device: the planner profiles one layer made real at a time (meta_profile.py)
            real = self._meta_build.layer_by_layer(module, self._weights) if self._meta_build is not None and built_on_meta(module) else None
            planned = auto_plan(self.planning_context(trainer), module, container, sample, shape, share=self._share_from_rank_zero, real=real)
            plan, self._planning_inputs = planned.plan, planned.inputs
        plan = resolve_plan(plan, self.plan_arguments)
        if self._planning_inputs is not None:  # one simulated step per plan: the one that runs
            plan = simulated_as_run(plan, self._planning_inputs)
        batch_rows = batch_size_of(sample)
        # evaluation cuts any batch into the plan's micro-batches (fewer where it is short);
        # only the training batch is the plan's global batch of one optimizer step
        require(
            trainer.state.fn != TrainerFn.FITTING or plan.global_batch_size == batch_rows,
            "plan.global_batch_size",
            f"is {plan.global_batch_size} but the DataLoader yields batches of {batch_rows}",
            "make the DataLoader's batch size the global batch of one optimizer step, or fix the plan",
        )
        return plan

    def _save_plan(self, trainer: Trainer) -> None:
        """Rank 0 writes the plan JSON (and, for planned runs, its table) to the log dir."""
        assert self.plan is not None
        directory = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks
        if self.global_rank != 0:
            return
        self.plan.save(directory / "dapple_plan.json")
        if self._planning_inputs is not None:
            profile, cluster = self._planning_inputs.profile, self._planning_inputs.cluster
            parts = [
                plan_table(self.plan, profile, cluster),
                plan_summary(self.plan),
                f"out-of-order backprop: {self.plan.extra.get('ooo_choice', self.plan.ooo)}",
            ]
            console = make_console()
            for part in parts:
                console.print(part)
            atomic_write_text(directory / "dapple_plan.txt", "".join(render_text(part) for part in parts))
            return
        rank_zero_info(f"dapple plan ({self.plan.kind()}, M={self.plan.micro_batches}, schedule={self.plan.schedule}):")
        for index, stage in enumerate(self.plan.stages):
            rank_zero_info(f"  stage {index}: layers [{stage.start}, {stage.end}) on ranks {list(stage.devices)}, K={stage.warmup}")
        rank_zero_info(f"  out-of-order backprop: {self.plan.extra.get('ooo_choice', self.plan.ooo)}")

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model

    @override
    def configure_ddp(self) -> None:  # no DDP wrapper: replicas sync per stage in the runner
        pass

    # -- training ------------------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The loops' batch stays where the DataLoader put it: each stage moves only the
        rows and fields it reads, per slice (``slice_transfer.py``; a middle stage moves
        nothing). A module with its own transfer hooks, and a call naming a device, get
        Lightning's whole-batch transfer."""
        if device is None and self.runner is not None and self._stages_move_slices:
            return batch
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    def _transfers_for(self, step_name: str) -> StepTransfers:
        """What the slices of ``step_name`` move to this rank's device (learned per step function)."""
        transfers = self._transfers.get(step_name)
        if transfers is None:
            transfers = self._transfers[step_name] = StepTransfers(self.root_device)
        return transfers

    @property
    def _logs_travel(self) -> bool:
        """Whether the last stage's logged values go to other ranks (through the host)."""
        return self.plan is not None and self.plan.world_size > 1

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.runner is not None and self.plan is not None
        module = self.lightning_module
        batch, batch_idx = args[0], (args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        recorder = LogRecorder()
        mixed = self._mixed()
        # Mixed precision: autocast around the forwards only (the executor's
        # forward_context and the user's step), never around the backward.
        context = mixed.forward_context if mixed is not None else nullcontext
        transfers = self._transfers_for("training_step")
        scale_backward = mixed.scale_backward if mixed is not None else None
        sliced = self.plan.micro_batches * self.plan.stages[-1].replicas > 1  # else each loss is the whole batch's
        watch = LossWatch() if self.loss_reduction == "mean" and sliced and not self._loss_checked else None
        self._loss_checked = True
        callbacks = _TrainCallbacks(module, batch_idx, recorder, transfers, batch_size_of(batch), context, scale_backward, watch, self._traced_inputs)
        scale = 1.0 / self.lightning_module.trainer.accumulate_grad_batches
        self.runner.refresh_trainable()  # a callback may have frozen or unfrozen layers since the last step
        if self._zero is not None:  # ZeRO-2: the (rebuilt) buckets reduce to the owners
            self._zero.route_gradients(self.runner)
        params = self.runner.parameters
        # Under Trainer(accumulate_grad_batches) the gradients of earlier batches are still
        # in .grad; the runner starts from none, so they are put back after the step. Where
        # Lightning zeroes them right after this step anyway, they go now: the stage would
        # otherwise hold two sets of gradients while the step runs.
        if _grads_zeroed_after_step(self.lightning_module.trainer, batch_idx, params, self._stepped_parameters()):
            for param in params:
                param.grad = None
        previous = [p.grad for p in params]
        rates = _learning_rates(self.optimizers)
        try:
            check_training_batch(self, batch, batch_idx)  # a bad batch is named before any rank runs it
            with nullcontext() if mixed is not None else self.precision_plugin.train_step_context():
                loss, logs = self.runner.train_step(batch, callbacks, extras=lambda: recorder.summary(on_host=self._logs_travel))
            check_training_loss(self, loss, batch_idx)  # before the optimizer takes it in
            _check_rates_kept(self.optimizers, rates)
        except BaseException as exc:
            self.failure.report(exc)
            raise
        if scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self._saved_grads = [p.grad for p in params]
        for p, grad in zip(params, previous):
            p.grad = grad
        dtype = _value_dtype(module)
        replay_logs(module, self._noticed(_merge_logs(logs)), callbacks.batch_rows, dtype)
        # on the device, as Lightning's loops expect (fp16: its loss scaling stays there too)
        return {"loss": loss.to(device=self.root_device, dtype=dtype, non_blocking=True)}

    def _noticed(self, logs: Logs) -> Logs:
        """``logs``, after warning once per name (rank 0, which replays them too) about a value
        logged with reduce_fx max, min or sum on a plan that cuts the batch
        (``module_adapter.combination_notice``)."""
        assert self.plan is not None
        for name, (_, _, kwargs) in logs.items():
            if name in self._noticed_logs:
                continue
            self._noticed_logs.add(name)
            notice = combination_notice(name, kwargs, self.plan.micro_batches, self.plan.stages[-1].replicas)
            if notice is not None:
                rank_zero_warn(notice)
        return logs

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The pipeline already ran every backward; restore its gradients, run the hooks."""
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._saved_grads is not None and self.runner is not None:
            for param, grad in zip(self.runner.parameters, self._saved_grads):
                if grad is None:
                    continue
                param.grad = grad if param.grad is None else param.grad + grad
            self._saved_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    # -- evaluation ----------------------------------------------------------------
    def _eval(self, step_name: str, args: tuple) -> Any:
        assert self.runner is not None
        module = self.lightning_module
        batch = args[0]
        recorder = LogRecorder()
        callbacks = _EvalCallbacks(module, step_name, tuple(args[1:]), recorder, self._transfers_for(step_name), self._traced_inputs)
        try:
            with torch.no_grad():
                outputs = self.runner.forward_step(batch, callbacks)
                logs = self.runner.share_extras(recorder.summary(on_host=self._logs_travel) if self.runner.is_last else None)
        except BaseException as exc:
            self.failure.report(exc)
            raise
        dtype = _value_dtype(module)
        replay_logs(module, self._noticed(_merge_logs(logs)), batch_size_of(batch), dtype)
        return _combine_outputs(outputs) if step_name == "predict_step" else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._eval("validation_step", args)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._eval("test_step", args)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._eval("predict_step", args)

    # -- checkpoints ---------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state, gathered from the stages on rank 0 (under "sharded":
        this rank's own entries, nothing gathered). In a process that set no pipeline up
        (the one that spawned the ranks, which holds the trained model after fit), the
        module's own, as under ``ddp_spawn``."""
        if self.checkpoint_layout is None:
            return super().lightning_module_state_dict()
        if self._sharded:
            return sharded.local_state_dict(self.lightning_module, self.checkpoint_layout)
        return ckpt.consolidated_state_dict(self.lightning_module, self.checkpoint_layout, self._checkpoint_lane())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.checkpoint_layout is None:  # as lightning_module_state_dict
            return super().optimizer_state(optimizer)
        if self._sharded:
            return sharded.local_optimizer_state(self.lightning_module, self.checkpoint_layout, optimizer)
        return ckpt.consolidated_optimizer_state(self.lightning_module, self.checkpoint_layout, optimizer, self._checkpoint_lane())

    @property
    def _sharded(self) -> bool:
        """Whether saves write sharded directories (a pipeline is set up and asked for them)."""
        return self.checkpoint_mode == "sharded" and self.checkpoint_layout is not None

    def _checkpoint_lane(self) -> PartLane:
        """The gloo path checkpoint parts take to rank 0 (``part_stream.py``), with, under
        "sharded", the writers' group (``sharded_checkpoint.WriterLane``); opened at the
        first save: every rank saves at the same point, as opening a group requires."""
        if self._part_lane is None:
            assert self.failure is not None
            lane = open_part_lane(ckpt.PartTurns(self.failure), timedelta(seconds=self.timeout_s))  # parts in turn (checkpoint.py)
            if self._sharded:
                assert self.checkpoint_layout is not None
                lane = sharded.open_writer_lane(lane, self.checkpoint_layout, self.timeout_s)
            self._part_lane = lane
        return self._part_lane

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded checkpoint directory gives Lightning its ``meta.pt``, the model and
        optimizer entries staying in the files until ``load_model_state_dict`` and
        ``load_optimizer_state_dict`` read this rank's; a file loads as under DDP."""
        if sharded.is_sharded(checkpoint_path):
            return sharded.load_meta(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if isinstance(checkpoint["state_dict"], sharded.ShardedSource):
            sharded.load_local_model(self.lightning_module, self.checkpoint_layout, checkpoint["state_dict"], strict=strict)
            return
        ckpt.load_local_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        assert self.checkpoint_layout is not None
        states = checkpoint["optimizer_states"]
        if states and isinstance(states[0], sharded.ShardedSource):
            sharded.load_local_optimizers(self.lightning_module, self.checkpoint_layout, self.optimizers, states)
            return
        ckpt.load_local_optimizer_states(self.lightning_module, self.checkpoint_layout, self.optimizers, states)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Rank 0 writes the file, every tensor in it on the CPU: the model and optimizer
        parts arrive there, and what Lightning adds (a callback's best score, a metric) is
        moved here, so the file loads on a machine without the devices that wrote it.

        Under "sharded", ``filepath`` becomes a directory: rank 0 makes a temporary one
        beside it, each writer (stage leader, rank 0) stores its part there, and rank 0
        swaps it in (``sharded_checkpoint.py``)."""
        if self._sharded:
            assert self.checkpoint_layout is not None
            require(storage_options is None, "save_checkpoint(storage_options)", "is given under checkpoint='sharded'",
                    "leave it out: the writers store through torch.distributed.checkpoint, not the CheckpointIO")
            staged = sharded.prepare_target(filepath) if self.is_global_zero else None
            target, staging = self.broadcast(staged)
            sharded.save_part(checkpoint, staging, self.checkpoint_layout, self._checkpoint_lane())
            if self.is_global_zero:
                sharded.publish(staging, target)
            return
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(to_host(checkpoint), filepath, storage_options=storage_options)

    @override
    @property
    def checkpoint_io(self) -> Any:
        if self._checkpoint_io is None:
            self._checkpoint_io = ckpt.AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        self._checkpoint_io = io

    @override
    def teardown(self) -> None:
        self._close_runner()
        module = self.lightning_module
        if self._hidden_example is not None and module is not None:
            module.example_input_array = self._hidden_example
            self._hidden_example = None
        if module is None or not built_on_meta(module):
            super().teardown()
            return
        # a model built on the meta device whose stage was never made (set-up refused it):
        # nothing of it can move to the CPU
        self._lightning_module = None
        try:
            super().teardown()
        finally:
            self._lightning_module = module

    def _hide_example_input(self, module: LightningModule) -> None:
        """Lightning runs ``forward`` on ``example_input_array`` outside the steps, on every
        rank (``ModelSummary``'s input and output sizes, a logger's ``log_graph``); on a
        pipeline a rank holds one stage's layers, so it is put aside while the Trainer runs
        and put back at teardown."""
        assert self.plan is not None
        if self.plan.num_stages == 1 or module.example_input_array is None:
            return
        self._hidden_example = module.example_input_array
        module.example_input_array = None
        rank_zero_info("dapple: example_input_array is put aside while the Trainer runs: each rank holds one stage, so "
                       "ModelSummary shows this rank's layers without sizes, and loggers draw no graph")

    @override
    def barrier(self, name: str | None = None) -> None:
        """Lightning's barriers (after rank 0 writes a checkpoint, ...) wait in the store for
        as long as the peers live (``execute/store_sync.py``), as under DDP, instead of
        timing out after ``timeout_s`` while rank 0 writes a large file."""
        sync = self._live_sync()
        if sync is None:
            super().barrier(name)
        else:
            sync.barrier(name or "barrier")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object on every rank, waited for as ``barrier`` is."""
        sync = self._live_sync()
        return super().broadcast(obj, src) if sync is None else sync.broadcast(obj, "Lightning's broadcast", src)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """``self.all_gather(x)`` stacks the values of the ranks that hold the data, the last
        stage's replicas, as DDP stacks its ranks' (DAPPLE 5.2.2: they see the global batch's
        rows between them); the other stages' ranks ran no step past ``self(...)``, so what
        they pass, of whatever shape, is left out, and they get the stacked values too."""
        plan = self.plan
        holders = list(plan.stages[-1].devices) if plan is not None else []
        world = group is None or group is dist.group.WORLD  # LightningModule.all_gather names WORLD for the default
        if not world or sync_grads or len(holders) in (0, self.world_size):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        sync = self._live_sync()
        assert sync is not None, "the failure channel starts before the plan"
        values = sync.gather(tensor.detach().cpu() if self.global_rank in holders else None, "self.all_gather")
        return torch.stack([values[rank] for rank in holders]).to(tensor.device)

    def _share_from_rank_zero(self, data: Any) -> Any:
        """Rank 0's planning result on every rank (``auto_plan``)."""
        sync = self._live_sync()
        assert sync is not None, "the failure channel starts before planning"
        return sync.broadcast(data, "the plan (profiling and planning)")

    def _live_sync(self) -> StoreSync | None:
        """The store waits while the failure channel watches the peers; None before it
        starts and after it stops (Lightning's own barriers then)."""
        if self._sync is None or self.failure is None or self.failure.closed or not dist.is_initialized():
            return None
        return self._sync

    def _close_runner(self) -> None:
        """Wait for the runner's last sends (none may outlive the process group; skipped after
        a failure, when peers may be gone) and stop the failure watchdog."""
        if self.runner is not None and self.failure is not None and not self.failure.failed:
            self.runner.finish()
        if self.failure is not None:
            self.failure.close()

    @override
    def on_train_end(self) -> None:
        """Give rank 0 the whole trained model back, as plain training would leave it.

        Every rank takes part in gathering the consolidated weights; rank 0 rebuilds the
        layers it freed from their meta-device skeletons on the CPU (the whole model need
        not fit its device; ``teardown`` moves the module to the CPU anyway) and loads them,
        then points handles and the tensors forward reads back at them (``handles.py``).
        Only with ``gather_after_fit`` (the default under "consolidated"): under "sharded"
        the model need not fit one process, and rank 0 keeps its own stage.
        """
        if self.plan is None or self.plan.num_stages == 1:
            return
        if not self.gather_after_fit:
            rank_zero_info("dapple: rank 0 keeps its own stage after fit (gather_after_fit=False); the trained model is in the checkpoints")
            return
        assert self.checkpoint_layout is not None
        state = ckpt.consolidated_state_dict(self.lightning_module, self.checkpoint_layout, self._checkpoint_lane())
        if self.global_rank != 0 or self._layer_container is None:
            return
        assert self._layer_tensors is not None
        for index, skeleton in sorted(self._freed.items()):
            self._layer_container[index] = self._layer_tensors.rebuild(skeleton, index, state)
        retie(self._layer_container, self._ties)  # the whole model again: one Parameter per tie
        self._freed = {}
        self._detached.reattach(self._layer_container)  # handles and forward's own tensors
