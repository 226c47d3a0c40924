"""Interpreter of a schedule's action list on one rank: the multi-process executor.

The runner owns nothing but the rank's own stage layers and walks the action list built
by ``lightning_dapple.schedule`` (the same list the simulator times):

* F: run the stage's layers on one micro-batch slice (the first stage takes it from the
  batch via ``make_input``; the last computes the loss via ``compute_loss``), stashing
  what backward needs (DAPPLE 3.2: at most K_i micro-batches in flight). Each F runs
  under an RNG seed of its own (step, stage, replica, micro-batch), so dropout masks do
  not depend on the order in which a schedule runs its forwards, and a recomputation
  replays them exactly;
* B: backpropagate that micro-batch, accumulating parameter gradients (5.2.3: "each
  device produces and accumulates gradients for all micro-batches"). When the schedule
  splits backward (out-of-order backprop, ooo-backprop sec. 3), the stage's GEMM-shaped
  modules leave their weight gradients to W (``execute/weight_grad.py``): B is still one
  ordinary backward that frees the graph, and the input gradient goes upstream at once
  (gradient fast-forwarding, 5.2);
* W: the deferred weight gradients of one micro-batch from the (input, output gradient)
  pairs B filed. A W limited to some layers runs only those (the ending phase of reverse
  first-k, Algorithm 2);
* recomputation (gpipe.txt 2.3, per stage ``never``/``always``/``except_last``): the F
  of a recomputed micro-batch keeps only the stage input; right before its B the stage
  forward is replayed under the same seed (buffers restored), and B/W then use that
  replay (see ``execute/replay.py`` for why this is not ``torch.utils.checkpoint``);
* send/receive: split-concat transfers to adjacent stages (5.2.2). Sends are asynchronous;
  a receive, once its data is in, also waits for the earlier sends ``schedule.settle``
  names (those the peer has already posted receives for), the rest at the end of the step;
* gradient AllReduce among the stage's replicas: bucketed and started as soon as each
  bucket's gradients are final, overlapping the rest of the backward
  (``execute/grad_sync.py``); the ALLREDUCE actions of the list mark where the simulator
  expects the last of them, and the step waits for all at its end.

Losses are weighted by (slice rows / global batch rows) for mean-reduced losses, so the
accumulated gradients are exactly those of one device on the whole global batch.

Stashed bytes follow ``schedule.ooo.stash_walk`` (the planner's rule) with measured
sizes: the saved tensors of the forward (``profile/stash.py``), the kept input of a
recomputed micro-batch, the output gradients a pending W keeps. Saved-tensor hooks cost
Python work on every saved tensor, so the sizes are measured in the first step of each
batch size and reused by the steps after it (what a forward saves depends on the layout
of its input, not on its values).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.grad_sync import GradientSync
from lightning_dapple.execute.groups import PlanGroups
from lightning_dapple.execute.replay import (
    discard_saved,
    frozen_buffers,
    reseed,
    restore_rng,
    save_rng,
    tensor_bytes,
    tensor_leaves,
    weight_groups,
)
from lightning_dapple.execute.results import ResultChannel
from lightning_dapple.execute.slicing import batch_size_of, flatten, slice_rows, take_rows
from lightning_dapple.execute.transport import Peer, Transport, receives_ahead_pay
from lightning_dapple.execute.weight_grad import WeightGradStore, deferrable_modules, install_deferred_weights
from lightning_dapple.plan.buckets import BUCKET_BYTES, bucket_layers
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.stash import StashMeter, parameter_storages
from lightning_dapple.schedule.actions import Action, Kind
from lightning_dapple.schedule.builders import Schedule
from lightning_dapple.schedule.settle import settle_points


class StageCallbacks(Protocol):
    """How the user's code enters the pipeline (provided by the Lightning glue)."""

    def make_input(self, batch: Any) -> Any:
        """First stage: the input of layer 0 for this batch slice."""

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> torch.Tensor:
        """Last stage: the loss of this slice; ``forward`` answers ``self(x)`` with the stage output."""


class EvalCallbacks(Protocol):
    def make_input(self, batch: Any) -> Any:
        """First stage: the input of layer 0 for this batch slice."""

    def compute_output(self, batch: Any, forward: Callable[..., Any], weight: float) -> Any:
        """Last stage: the (picklable) result of the eval step on this slice."""


@dataclass
class StageStats:
    """What the executor measured on this rank during the last step.

    ``timeline`` holds (start, end, kind, micro-batch) of every F, B (recomputation
    included) and W, in ``time.perf_counter`` seconds.
    """

    peak_in_flight: int = 0
    peak_stash_bytes: int = 0
    stash_bytes: dict[int, int] = field(default_factory=dict)
    timeline: list[tuple[float, float, str, int]] = field(default_factory=list)
    recomputed: int = 0


@dataclass(slots=True)
class _MicroBatch:
    rows: tuple[int, int]
    inputs: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    # last stage, recomputed: the detached stage outputs the loss was computed from
    y: list[torch.Tensor] | None = None
    w_todo: int = 0  # W actions still to come for this micro-batch
    sent: bool = False


@dataclass(slots=True)
class _Step:
    """State of one training step on this rank (what the action handlers share)."""

    batch: Any
    rows: int
    callbacks: StageCallbacks
    loss_scale: float
    measure: set[int] | None  # parameter storages to leave out while measuring stash; None: reuse sizes
    sizes: dict[Any, int]  # (micro-batch, "F" | "R") -> stashed bytes, measured or reused
    state: dict[int, _MicroBatch] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)


class StageRunner:
    """Runs this rank's part of a plan, one action list per step."""

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        rank: int,
        layers: Sequence[nn.Module],
        device: torch.device,
        failure: FailureChannel,
        groups: PlanGroups,
        loss_reduction: str = "mean",
        post_ahead: bool | None = None,
        settle_sends: bool = True,
        forward_context: Callable[[], ContextManager[Any]] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        wire: str = "auto",
    ) -> None:
        self.plan = plan
        self.schedule = schedule
        self.rank = rank
        self.stage = plan.stage_of_rank(rank)
        self.stage_plan = plan.stages[self.stage]
        self.replica = self.stage_plan.devices.index(rank)
        self.layers = list(layers)
        self.device = device
        self.failure = failure
        self.transport = Transport(failure, device, wire=wire)  # a collective under NCCL: every rank builds its runner
        self.results = ResultChannel(plan, rank, device, failure)
        # post each receive one transfer ahead (None: where that pays, see receives_ahead_pay)
        self.post_ahead = self.transport.posts_ahead and (receives_ahead_pay(device) if post_ahead is None else post_ahead)
        self.groups = groups
        self.replica_groups = groups.replicas
        self.loss_reduction = loss_reduction
        self.forward_context = forward_context or contextlib.nullcontext
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.num_stages - 1
        self.stats = StageStats()
        self.parameters = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
        self.steps_done = 0  # training steps run so far (part of every dropout seed; a resume sets it)
        self._base_seed = torch.initial_seed()
        self._peer_cache: dict[tuple[int, int, int], list[Peer]] = {}
        self._stash_sizes: dict[Any, dict[Any, int]] = {}  # per (batch rows, training): measured sizes
        self._buffers = [buffer for layer in self.layers for buffer in layer.buffers()]
        self._actions: list[Action] = list(schedule.actions[self.stage]) if self.stage < schedule.num_stages else []
        compute = [a for a in self._actions if a.kind.is_compute]
        self._plan_backward(schedule, compute)
        self._plan_receives(schedule, settle_sends)
        self.sync = self._build_sync(bucket_bytes)

    # -- set-up: everything decided once per plan ----------------------------------
    def _plan_backward(self, schedule: Schedule, compute: list[Action]) -> None:
        """Split backward (out-of-order backprop) or not, and what each W covers."""
        any_w = any(a.kind is Kind.W for acts in schedule.actions for a in acts)
        self.split = any(a.kind is Kind.W for a in compute) or (schedule.split_backward and not any_w)
        self.recomputed = schedule.recomputed(self.stage) if self.stage < schedule.num_stages else frozenset()
        self.store = WeightGradStore()
        self._final_after: dict[int, list[nn.Parameter]] = {}  # see _build_sync
        self._last_b = -1
        self._hooked: list[nn.Parameter] = []
        self._deferred: list[list[nn.Parameter]] = [[] for _ in self.layers]
        if self.split:
            install_deferred_weights(self.layers, self.store)
            for index, layer in enumerate(self.layers):
                self._deferred[index] = _unique(p for m in deferrable_modules(layer) for p in m.parameters(recurse=False) if p.requires_grad)
        self._w_count: dict[int, int] = {}
        for action in compute:
            if action.kind is Kind.W and action.microbatch is not None:
                self._w_count[action.microbatch] = self._w_count.get(action.microbatch, 0) + 1
        # a W limited to some layers covers whole weight groups (layers sharing a parameter)
        groups = weight_groups(self.layers)
        self._w_span: dict[tuple[int, int], tuple[int, int]] = {}
        for action in compute:
            if action.kind is Kind.W and action.layers is not None and action.layers not in self._w_span:
                lo, hi = action.layers
                meets = [g for g in groups if g[0] < hi and g[1] > lo]
                self._w_span[action.layers] = (min([lo] + [g[0] for g in meets]), max([hi] + [g[1] for g in meets]))

    def _plan_receives(self, schedule: Schedule, settle_sends: bool) -> None:
        # positions of this stage's receive actions (what ``_post_ahead`` looks for)
        self._receive_positions = [i for i, a in enumerate(self._actions) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        # per receive position: the earlier sends it waits for too (schedule/settle.py);
        # settle_sends=False leaves every send to the end of the step (the benchmarks' ablation)
        self._settle_at = settle_points(schedule.actions)[self.stage] if settle_sends and self.stage < schedule.num_stages else {}
        self._next_receive = [len(self._receive_positions)] * (len(self._actions) + 1)
        upcoming = len(self._receive_positions)
        for position in range(len(self._actions) - 1, -1, -1):
            while upcoming > 0 and self._receive_positions[upcoming - 1] > position:
                upcoming -= 1
            self._next_receive[position] = upcoming

    def _build_sync(self, bucket_bytes: int) -> GradientSync | None:
        """The stage's gradient buckets and when each parameter's gradient is final."""
        group = self.replica_groups.get(self.stage)
        if group is None or not self.parameters:
            return None
        owned: list[list[nn.Parameter]] = []
        seen: set[int] = set()
        for layer in self.layers:
            owned.append([p for p in layer.parameters() if p.requires_grad and id(p) not in seen])
            seen.update(id(p) for p in owned[-1])
        sizes = [sum(p.numel() * p.element_size() for p in params) for params in owned]
        buckets = [[p for layer in range(lo, hi) for p in owned[layer]] for lo, hi in bucket_layers(sizes, 0, len(owned), bucket_bytes)]
        deferred = {id(p) for params in self._deferred for p in params}
        hooked = [p for p in self.parameters if id(p) not in deferred]
        self._final_after = self._final_positions()
        self._last_b = max((i for i, a in enumerate(self._actions) if a.kind is Kind.B), default=-1)
        self._hooked = hooked
        return GradientSync(buckets, hooked, group, self.failure, self.stage)

    def _final_positions(self) -> dict[int, list[nn.Parameter]]:
        """Per action position: the deferred parameters whose last W work it does."""
        last: dict[int, int] = {}  # layer -> position of its last deferred work
        done: dict[int, set[int]] = {}  # micro-batch -> layers whose W ran
        left = dict(self._w_count)
        every = set(range(len(self.layers)))
        for position, action in enumerate(self._actions):
            mb = action.microbatch
            if action.kind is Kind.B and mb is not None and left.get(mb, 0) == 0:
                for layer in every:  # no W scheduled: the weight work runs right after B
                    last[layer] = position
            elif action.kind is Kind.W and mb is not None:
                left[mb] -= 1
                span = self._w_span.get(action.layers) if action.layers is not None and left[mb] > 0 else None
                layers = set(range(*span)) if span is not None else every - done.get(mb, set())
                done.setdefault(mb, set()).update(layers)
                for layer in layers:
                    last[layer] = position
        final: dict[int, list[nn.Parameter]] = {}
        for layer, position in last.items():
            final.setdefault(position, []).extend(self._deferred[layer])
        return final

    # -- helpers ---------------------------------------------------------------
    def _rows(self, stage: int, replica: int, batch_rows: int, microbatch: int) -> tuple[int, int]:
        return slice_rows(batch_rows, self.plan.micro_batches, microbatch, self.plan.stages[stage].replicas, replica)

    def _peers(self, stage: int, batch_rows: int, microbatch: int) -> list[Peer]:
        """The ranks of ``stage`` and the rows of ``microbatch`` each holds (memoised: the same
        few answers are asked for on every step, on the per-micro-batch path)."""
        key = (stage, batch_rows, microbatch)
        peers = self._peer_cache.get(key)
        if peers is None:
            devices = self.plan.stages[stage].devices
            peers = [Peer(rank, self._rows(stage, index, batch_rows, microbatch)) for index, rank in enumerate(devices)]
            self._peer_cache[key] = peers
        return peers

    def run_layers(self, x: Any, meter: StashMeter | None = None) -> Any:
        """Apply the stage's layers; with ``meter``, count what each layer stashes (the
        layers only: the loss's own saves are not in any profile)."""
        if meter is None:
            for layer in self.layers:
                x = layer(x)
            return x
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            for layer in self.layers:
                meter.next_layer()
                x = layer(x)
        return x

    def check_batch(self, batch_rows: int) -> None:
        widest = max(stage.replicas for stage in self.plan.stages)
        if batch_rows < self.plan.micro_batches * widest:
            raise DappleConfigError(
                "batch",
                f"has {batch_rows} samples, too few for {self.plan.micro_batches} micro-batches sliced over up to {widest} replicas",
                "use a larger batch, fewer micro-batches, or DataLoader(drop_last=True) to avoid a short last batch",
            )

    def _seed(self, microbatch: int) -> int:
        """The RNG seed of one micro-batch's forward on this rank in this step."""
        return hash((self._base_seed, self.steps_done, self.stage, self.replica, microbatch)) & 0x7FFF_FFFF_FFFF_FFFF

    # -- stash accounting (schedule.ooo.stash_walk with measured sizes) ----------
    def _hold(self, step: _Step, mb: int, nbytes: int) -> None:
        step.held[mb] = step.held.get(mb, 0) + nbytes
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, sum(step.held.values()))

    # -- training ----------------------------------------------------------------
    def train_step(
        self,
        batch: Any,
        callbacks: StageCallbacks,
        extras: Callable[[], Any] | None = None,
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, list[Any]]:
        """Run one optimizer step's forward/backward work; gradients are left in ``.grad``.

        The backward starts from the loss times ``loss_scale`` (fp16 loss scaling); the
        returned loss of the whole global batch (the same on every rank) is unscaled, with
        the list of what ``extras()`` returned on each last-stage replica (on every rank).
        """
        batch_rows = batch_size_of(batch)
        self.check_batch(batch_rows)
        for param in self.parameters:
            param.grad = None
        self.stats = StageStats()
        layout = (batch_rows, bool(self.layers) and self.layers[0].training)
        known = self._stash_sizes.get(layout)
        step = _Step(
            batch, batch_rows, callbacks, float(loss_scale),
            measure=parameter_storages(self.parameters) if known is None else None,
            sizes=known if known is not None else {},
        )
        if self.sync is not None:
            self.sync.start_step()
        self.results.post()
        rng = save_rng(self.device)  # every F reseeds; the caller's RNG stream is put back when the step ends
        self._base_seed = torch.initial_seed()  # before any reseed changes what initial_seed() answers
        try:
            self._run_actions(step)
            self.transport.flush()
            if self.sync is not None:
                self.sync.finish()
        finally:
            restore_rng(rng)
            self.store.clear()
            self.steps_done += 1
        if known is None:
            self._stash_sizes[layout] = step.sizes
        losses = step.losses
        loss_sum = torch.stack(losses).to(torch.float64).sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        loss, shared = self.results.share(loss_sum, extras() if (extras is not None and self.is_last) else None)
        assert loss is not None
        return loss, shared

    def _run_actions(self, step: _Step) -> None:
        actions = self._actions
        receives = self._receive_positions
        final_after = self._final_after
        for position, action in enumerate(actions):
            kind = action.kind
            if self.post_ahead and kind.is_compute:
                upcoming = self._next_receive[position]
                if upcoming < len(receives):
                    self._post_ahead(actions[receives[upcoming]], step)
            mb = action.microbatch
            if kind is Kind.F:
                self._do_forward(step, mb)
            elif kind is Kind.B:
                self._do_backward(step, mb, position)
            elif kind is Kind.W:
                self._do_weight(step, mb, action.layers)
            elif kind is Kind.RECV_ACT:
                rows = self._rows(self.stage, self.replica, step.rows, mb)
                inputs = self.transport.recv_activation(rows, self._peers(self.stage - 1, step.rows, mb), f"activation {mb}")
                step.state[mb] = _MicroBatch(rows=rows, inputs=inputs)
                self.transport.settle(self._settle_at.get(position))
            elif kind is Kind.SEND_ACT:
                item = step.state[mb]
                self.transport.send_activation(item.outputs, item.rows, self._peers(self.stage + 1, step.rows, mb), f"activation {mb}", (kind, mb))
            elif kind is Kind.RECV_GRAD:
                item = step.state[mb]
                like = [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]
                grads = self.transport.recv_gradient(like, item.rows, self._peers(self.stage + 1, step.rows, mb), f"gradient {mb}")
                item.outputs = (like, grads)
                self.transport.settle(self._settle_at.get(position))
            elif kind is Kind.SEND_GRAD:
                item = step.state[mb]
                grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in self._grad_inputs(item)]
                self.transport.send_gradient(grads, item.rows, self._peers(self.stage - 1, step.rows, mb), f"gradient {mb}", (kind, mb))
                item.inputs = None
                item.sent = True
                self._release(step, mb)
            elif kind is not Kind.ALLREDUCE:  # AllReduce buckets start when their gradients are final (grad_sync)
                raise NotImplementedError(f"action {action} is not supported by this executor")
            if self.sync is not None and position in final_after:
                self.sync.ready_all(final_after[position])

    def _post_ahead(self, action: Action, step: _Step) -> None:
        """Post the receives of the next receive action before this compute runs, so its
        data arrives meanwhile (one transfer ahead, in action order: see transport)."""
        mb = action.microbatch
        what = f"{'activation' if action.kind is Kind.RECV_ACT else 'gradient'} {mb}"
        if self.transport.is_posted(what):
            return
        if action.kind is Kind.RECV_ACT:
            rows = self._rows(self.stage, self.replica, step.rows, mb)
            self.transport.post_activation(rows, self._peers(self.stage - 1, step.rows, mb), what)
            return
        item = step.state.get(mb)
        if item is None or item.outputs is None:
            return  # its forward has not run yet: sizes unknown
        like = [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]
        self.transport.post_gradient(like, item.rows, self._peers(self.stage + 1, step.rows, mb), what)

    def _release(self, step: _Step, mb: int) -> None:
        item = step.state.get(mb)
        if item is not None and item.sent and item.w_todo <= 0 and item.outputs is None:
            step.state.pop(mb)

    # -- forward -----------------------------------------------------------------
    def _do_forward(self, step: _Step, mb: int) -> None:
        start = time.perf_counter()
        item = step.state.get(mb)
        if item is None:
            item = step.state[mb] = _MicroBatch(rows=self._rows(self.stage, self.replica, step.rows, mb))
        recompute = mb in self.recomputed
        meter = StashMeter(step.measure) if step.measure is not None and not recompute else None
        self.store.recording = mb if self.split and not recompute else None
        try:
            reseed(self._seed(mb), self.device)
            with self.forward_context():
                self._forward(item, take_rows(step.batch, *item.rows), step, recompute, meter)
        finally:
            self.store.recording = None
        if recompute:
            stashed = step.sizes.get((mb, "F"))
            if stashed is None:  # measured in the first step of a batch size only
                stashed = step.sizes[(mb, "F")] = tensor_bytes(item.inputs)
        elif meter is not None:
            stashed = step.sizes[(mb, "F")] = meter.bytes
        else:
            stashed = step.sizes.get((mb, "F"), 0)
        self.stats.stash_bytes[mb] = stashed
        self._hold(step, mb, stashed)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(step.held))
        self.stats.timeline.append((start, time.perf_counter(), "F", mb))

    def _forward(self, item: _MicroBatch, batch_slice: Any, step: _Step, recompute: bool, meter: StashMeter | None) -> None:
        callbacks = step.callbacks
        if not self.is_last:
            x = callbacks.make_input(batch_slice) if self.is_first else item.inputs
            if recompute:
                item.inputs = x
                with discard_saved():
                    item.outputs = _detached(self.run_layers(x))
            else:
                item.outputs = self.run_layers(x, meter)
            return
        received = item.inputs

        def forward(*args: Any, **kwargs: Any) -> Any:
            x = (args[0] if len(args) == 1 else args) if self.is_first else received
            if not recompute:
                return self.run_layers(x, meter)
            item.inputs = x
            with discard_saved():
                y = _detached(self.run_layers(x))
            item.y = [leaf for leaf in tensor_leaves(y) if leaf.requires_grad]
            return y

        loss = callbacks.compute_loss(batch_slice, forward)
        weight = (item.rows[1] - item.rows[0]) / step.rows if self.loss_reduction == "mean" else 1.0
        loss = loss * weight
        step.losses.append(loss.detach())
        item.loss = loss * step.loss_scale if step.loss_scale != 1.0 else loss

    def _recompute(self, step: _Step, mb: int, item: _MicroBatch) -> Any:
        """Replay the stage forward of ``mb`` with autograd (same seed, buffers kept) and
        hold what it stashes; returns the stage output with its graph."""
        meter = StashMeter(step.measure) if step.measure is not None else None
        self.store.recording = mb if self.split else None
        try:
            reseed(self._seed(mb), self.device)  # the step restores the caller's RNG state
            with frozen_buffers(self._buffers), self.forward_context():
                outputs = self.run_layers(item.inputs, meter)
        finally:
            self.store.recording = None
        if meter is not None:
            step.sizes[(mb, "R")] = meter.bytes
        self.stats.recomputed += 1
        self._hold(step, mb, step.sizes.get((mb, "R"), 0))
        return outputs

    def _grad_inputs(self, item: _MicroBatch) -> list[torch.Tensor]:
        return [leaf for leaf in flatten(item.inputs)[0] if leaf.requires_grad]

    # -- backward ------------------------------------------------------------------
    def _roots(self, step: _Step, mb: int, item: _MicroBatch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """What B starts from: the loss (last stage) or the stage outputs with the
        gradients received for them; for a recomputed micro-batch, the replayed outputs."""
        if mb not in self.recomputed:
            if self.is_last:
                assert item.loss is not None
                return [item.loss], None
            outputs, grads = item.outputs
            return list(outputs), list(grads)
        if self.is_last:
            assert item.loss is not None and item.y is not None
            grads = list(torch.autograd.grad(item.loss, item.y, allow_unused=True)) if item.y else []
            grads = [g if g is not None else torch.zeros_like(y) for g, y in zip(grads, item.y)]
            like: list[torch.Tensor] = item.y
        else:
            like, grads = item.outputs
        replayed = [leaf for leaf in tensor_leaves(self._recompute(step, mb, item)) if leaf.requires_grad]
        if len(replayed) != len(like):
            raise RuntimeError(
                f"stage {self.stage}: the recomputed forward of micro-batch {mb} has {len(replayed)} outputs that require grad, "
                f"the original had {len(like)}; recomputation needs a forward that depends only on its input and the RNG"
            )
        return replayed, list(grads)

    def _do_backward(self, step: _Step, mb: int, position: int) -> None:
        start = time.perf_counter()
        item = step.state[mb]
        roots, root_grads = self._roots(step, mb, item)
        item.loss = None
        item.y = None
        final = self.sync is not None and position == self._last_b
        if final:
            self.sync.live = True  # the last backward: autograd reports finished gradients
        if roots:
            torch.autograd.backward(roots, root_grads)
        if final:
            self.sync.live = False
            self.sync.ready_all(self._hooked)  # also those that got no gradient in this B
        item.outputs = None
        item.w_todo = self._w_count.get(mb, 0) if self.split else 0
        if item.w_todo > 0:
            self._hold(step, mb, self.store.held_bytes(mb))
        else:
            self.store.run(mb)  # split but no W scheduled for it: the weight work runs now
            step.held.pop(mb, None)
        self.stats.timeline.append((start, time.perf_counter(), "B", mb))
        if self.is_first:
            item.sent = True
        self._release(step, mb)

    def _do_weight(self, step: _Step, mb: int, layers: tuple[int, int] | None) -> None:
        """W: the deferred weight gradients of ``mb`` (those of ``layers`` unless this is its
        last W, which does all that is left)."""
        start = time.perf_counter()
        item = step.state[mb]
        item.w_todo -= 1
        self.store.run(mb, self._w_span.get(layers) if layers is not None and item.w_todo > 0 else None)
        self.stats.timeline.append((start, time.perf_counter(), "W", mb))
        if item.w_todo <= 0:
            step.held.pop(mb, None)
            self._release(step, mb)

    def finish(self) -> None:
        """Wait for every send still pending (the last results hand-off), so that no send
        outlives the runner or the process group it was issued on."""
        self.transport.flush()
        self.results.flush()

    def share_extras(self, obj: Any) -> list[Any]:
        """Objects of every last-stage replica (in replica order), on every rank of the plan."""
        return self.results.share(None, obj)[1]

    # -- forward only (validation, test, predict) -------------------------------
    def forward_step(self, batch: Any, callbacks: "EvalCallbacks") -> list[Any]:
        """GPipe-style forward of every micro-batch; returns the last stage's per-slice
        results ordered by (micro-batch, replica), on every rank."""
        batch_rows = batch_size_of(batch)
        self.check_batch(batch_rows)
        results: list[Any] = []
        self.results.post()
        with torch.no_grad(), self.forward_context():
            for mb in range(self.plan.micro_batches):
                rows = self._rows(self.stage, self.replica, batch_rows, mb)
                batch_slice = take_rows(batch, *rows)
                if self.is_first:
                    received = None if self.is_last else callbacks.make_input(batch_slice)
                else:
                    received = self.transport.recv_activation(rows, self._peers(self.stage - 1, batch_rows, mb), f"activation {mb}")
                if self.is_last:
                    first_input = received

                    def forward(*args: Any, **kwargs: Any) -> Any:
                        if self.is_first:
                            return self.run_layers(args[0] if len(args) == 1 else args)
                        return self.run_layers(first_input)

                    results.append(callbacks.compute_output(batch_slice, forward, (rows[1] - rows[0]) / batch_rows))
                else:
                    outputs = self.run_layers(received)
                    self.transport.send_activation(outputs, rows, self._peers(self.stage + 1, batch_rows, mb), f"activation {mb}")
        self.transport.flush()
        gathered = self.share_extras(results if self.is_last else None)
        replicas = self.plan.stages[-1].replicas
        return [gathered[replica][mb] for mb in range(self.plan.micro_batches) for replica in range(replicas)]


def _unique(params: Any) -> list[nn.Parameter]:
    out, seen = [], set()
    for param in params:
        if id(param) not in seen:
            seen.add(id(param))
            out.append(param)
    return out


def _detached(value: Any) -> Any:
    """``value`` with every tensor detached, keeping which of them require grad."""
    from torch.utils import _pytree as pytree

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(cut, value)
