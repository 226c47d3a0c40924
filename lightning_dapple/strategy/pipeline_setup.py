"""How ``DappleStrategy.setup`` turns the user's module into this rank's stage: the plan,
the layer list and its checks, the freed stages, the optimizers and precision.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_dapple.cluster import detect_cluster, load_cluster
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.batchnorm import convert_batchnorm
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import build_groups
from lightning_dapple.execute.random_layers import draws_random
from lightning_dapple.execute.runner import StageRunner
from lightning_dapple.execute.slicing import batch_size_of, take_rows
from lightning_dapple.execute.store_sync import StoreSync
from lightning_dapple.execute.topology import report_placement
from lightning_dapple.plan.console import make_console, render_text
from lightning_dapple.plan.explain import plan_summary, plan_table
from lightning_dapple.atomic_files import atomic_write_text
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.hf_layers import is_hf_layer_list
from lightning_dapple.profile.ties import tied_parameters
from lightning_dapple.profile.traced_layers import TracedLayers
from lightning_dapple.strategy import checkpoint as ckpt
from lightning_dapple.strategy.auto_plan import (
    PlanningContext,
    auto_plan,
    simulated_as_run,
)
from lightning_dapple.strategy.handles import LayerTensors
from lightning_dapple.strategy.hf_weights import pretrained_weights
from lightning_dapple.strategy.layer_rows import check_regrouped_cuts, rows_elsewhere
from lightning_dapple.strategy.meta_build import built_on_meta
from lightning_dapple.strategy.module_adapter import (
    FreedLayer,
    check_parameters_in_layers,
    find_layers,
    key_owners,
    module_home,
    state_aliases,
)
from lightning_dapple.strategy.precision import (
    GlobalNormClipping,
)
from lightning_dapple.strategy.reporting import (
    stop_at_failure,
)
from lightning_dapple.strategy.resolve import (
    given_plan,
    resolve_plan,
    shape_with_arguments,
)
from lightning_dapple.strategy.setup_checks import (
    check_callbacks,
    output_leaves,
    run_or_explain,
)
from lightning_dapple.strategy.step_callbacks import forward_args, current_step_name
from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer
from lightning_dapple.strategy.zero import ZeroShards


class PipelineSetup:
    """Part of :class:`~lightning_dapple.strategy.dapple_strategy.DappleStrategy` (module docstring);
    its methods read the strategy's state, set up in ``DappleStrategy.__init__``."""

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

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        require(
            isinstance(plugin, GlobalNormClipping),
            "Trainer(precision)",
            f"uses {type(plugin).__name__}, which the dapple strategy does not support",
            "use precision='32-true', '64-true', 'bf16-true', '16-true', 'bf16-mixed' or '16-mixed'",
        )

    def _connect_precision(self) -> None:
        """Hand the precision plugin the pipeline's collectives (precision.py): the global
        gradient norm for clipping and, under fp16, the agreed inf/nan check."""
        plugin = self.precision_plugin
        assert isinstance(plugin, GlobalNormClipping)
        plugin.clip_norm = self._clip_by_global_norm
        mixed = self._mixed()
        if mixed is not None:
            mixed.agree = self._agree_found_inf

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
        check_callbacks(trainer, plan)
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
        step_name = current_step_name(trainer)

        def samples() -> list[tuple]:
            counts = sorted({1, min(2, batch_size_of(batch))})
            return [forward_args(module, take_rows(batch, 0, count), step_name) for count in counts]

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
        step_name = current_step_name(trainer)
        rows = min(2, batch_size_of(batch))
        args = forward_args(module, take_rows(batch, 0, rows), step_name)
        state = torch.random.get_rng_state()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                expected = run_or_explain(lambda: module(*args), f"{type(module).__name__}.forward", args, step_name, self.layers_path)
                outputs = self._layer_outputs(container, args, step_name)
                actual = outputs[-1]
                self._rows_elsewhere = {}
                if rows == 2:
                    one = self._layer_outputs(container, forward_args(module, take_rows(batch, 0, 1), step_name), step_name)
                    self._rows_elsewhere = rows_elsewhere([one, outputs], [1, 2])
        finally:
            module.train(was_training)
            torch.random.set_rng_state(state)
        left, right = output_leaves(expected), output_leaves(actual)
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
            value = run_or_explain(lambda: layer(value), f"{self.layers_path}[{index}] ({type(layer).__name__})", args, step_name, self.layers_path)
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
            step_name=current_step_name(trainer),
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
        if self.tune_steps and given is None and trainer.state.fn == TrainerFn.FITTING:  # every rank alike
            plan = self._tuned_plan(trainer, module, container, sample, plan)
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
