"""``Trainer(strategy="dapple")``: DAPPLE hybrid pipeline/data parallelism for Lightning.

The strategy reuses Lightning's DDP machinery for what is the same (launchers, process
group set-up, cluster environments) and replaces what differs. The class here coordinates
(construction, process groups, ``setup``, the run's end); each of its parts has its own
module: ``pipeline_setup.py`` (the plan, the layer list and this rank's stage),
``step_hooks.py`` (the Lightning steps, backward, the optimizer step),
``checkpoint_hooks.py`` (saving and loading), ``setup_checks.py`` (what is refused before
set-up) and ``step_callbacks.py`` (the calls into the user's step functions).

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

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_dapple.errors import require
from lightning_dapple.execute.chunked import ChunkedRunner
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import PlanGroups
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.shutdown import destroy_groups_at_exit
from lightning_dapple.execute.store_sync import StoreSync
from lightning_dapple.execute.transfer.wires import WIRES, choose_wire
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.ties import TiedParameter
from lightning_dapple.strategy import checkpoint as ckpt
from lightning_dapple.strategy import sharded_checkpoint as sharded
from lightning_dapple.strategy.auto_plan import PlanningInputs
from lightning_dapple.strategy.ddp_options import refuse_ddp_options
from lightning_dapple.strategy.handles import Detached, LayerTensors
from lightning_dapple.strategy.hf_weights import PretrainedWeights
from lightning_dapple.strategy.meta_build import MetaBuild, built_on_meta
from lightning_dapple.strategy.param_groups import append_missing_groups
from lightning_dapple.strategy.part_stream import PartLane
from lightning_dapple.strategy.precision import (
    DapplePrecision,
    as_dapple_precision,
)
from lightning_dapple.strategy.reporting import (
    SILENT,
    OneLineLauncher,
    failure_known,
    install_excepthook,
    publish_failure,
    watch_for_lightning_waits,
    watch_for_peer_failures,
)
from lightning_dapple.strategy.resolve import PlanArguments
from lightning_dapple.strategy.rng_guard import random_states, random_streams_kept, share_rank_zero_streams
from lightning_dapple.strategy.slice_transfer import StepTransfers
from lightning_dapple.strategy.tied_layers import retie
from lightning_dapple.strategy.unshare import unshare_run_tensors
from lightning_dapple.strategy.zero import ZeroShards
from lightning_dapple.strategy.checkpoint_hooks import CheckpointHooks
from lightning_dapple.strategy.pipeline_setup import PipelineSetup
from lightning_dapple.strategy.plan_tuning import PlanTuning, check_tune_settings
from lightning_dapple.strategy.setup_checks import check_module
from lightning_dapple.strategy.step_hooks import PipelineSteps
from lightning_dapple.strategy.tune_candidates import DEFAULT_TUNE_CANDIDATES


LOSS_REDUCTIONS = ("mean", "sum", "micro_batch_mean")


class DappleStrategy(PipelineSetup, PlanTuning, PipelineSteps, CheckpointHooks, DDPStrategy):
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
        profile_cache: directory for cached layer profiles (and measured plan choices).
        tune_steps: with plan="auto", measure the simulator's best few plans for this many
            steps each on the first training batch and keep the fastest measured
            (``plan_tuning.py``: exact, training continues as if tuning never ran; the
            choice is cached beside the profiles, so the next run with the same model,
            cluster and batch does not tune again). 0 (default): the simulator decides.
        tune_candidates: how many plans ``tune_steps`` measures (the simulator's choice
            and the best of its rivals, ``tune_candidates.py``).
        ooo: out-of-order backprop (weight gradients deferred into idle time): True, False
            or "auto" (on where the simulator says it helps this plan, see
            ``strategy/ooo_choice.py``; the choice and its reason are in the plan JSON).
        recompute: "never", "always", "except_last", one mode per stage, or "auto"
            (chosen by the memory model under plan="auto").
        wire: how stage boundaries travel (``execute/transfer/wires.py``): "auto" (gloo for CPU
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
        tune_steps: int = 0,
        tune_candidates: int = DEFAULT_TUNE_CANDIDATES,
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
        require(recompute != "auto" or plan == "auto", "recompute", "is 'auto' but the plan is given explicitly; 'auto' needs the profile that plan='auto' measures",
                "use plan='auto', or name a mode per stage (never/always/except_last)")
        require(wire in WIRES, "wire", f"is {wire!r}", f"use one of {', '.join(WIRES)}")
        self.wire, self.deferred_batchnorm = wire, deferred_batchnorm
        self.meta_init, self.pretrained = meta_init, pretrained
        require(zero in (0, 1, 2, "auto"), "zero", f"is {zero!r}", "use 'auto' (the planner chooses per stage), 0 (every replica keeps the whole optimizer state), 1 (ZeRO-1: each keeps its share) or 2 (ZeRO-2: also its share of the gradients)")
        self.zero = zero
        check_tune_settings(tune_steps, tune_candidates, plan)
        self.tune_steps, self.tune_candidates = tune_steps, tune_candidates
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
        check_module(module)
        # a spawn launch hands every rank one shared storage per tensor: each its own now
        unshare_run_tensors(module, trainer.callbacks, weights=self.root_device.type == "cpu")
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

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model

    @override
    def configure_ddp(self) -> None:  # no DDP wrapper: replicas sync per stage in the runner
        pass

    # -- the run's end and Lightning's collectives ------------------------------------
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
