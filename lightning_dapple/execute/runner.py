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
  splits backward (out-of-order backprop, ooo-backprop sec. 3), B computes only the
  gradient with respect to the stage input and the gradients W will start from (one
  ``autograd.grad`` over the retained graph); the gradient goes upstream at once
  (gradient fast-forwarding, 5.2);
* W: the deferred weight gradients of one micro-batch, layer by layer from the same graph
  (``autograd.grad`` from where each layer's weight work starts -- the outputs of its
  weight-consuming operations, see ``execute/recompute.py`` -- to its parameters, with the
  gradients B kept there). A W limited to some layers runs only those (the ending phase of
  reverse first-k, Algorithm 2); the graph goes when the micro-batch's last W is done;
* recomputation (gpipe.txt 2.3, per stage ``never``/``always``/``except_last``): the F
  of a recomputed micro-batch keeps only the stage input; right before its B the stage
  forward is replayed under the same seed (buffers restored), and B/W then use that one
  graph (see ``execute/recompute.py`` for why this is not ``torch.utils.checkpoint``);
* send/receive: split-concat transfers to adjacent stages (5.2.2). Sends are asynchronous;
  a receive, once its data is in, also waits for the earlier sends ``schedule.settle``
  names (those the peer has already posted receives for), the rest at the end of the step;
* ALLREDUCE: sum the accumulated gradients among the stage's replicas, started as soon as
  the stage's last backward is done and waited at the end of the step; an ALLREDUCE
  limited to some layers is an asynchronous bucket of just their gradients.

Losses are weighted by (slice rows / global batch rows) for mean-reduced losses, so the
accumulated gradients are exactly those of one device on the whole global batch.

Stashed bytes follow ``schedule.ooo.stash_walk`` (the planner's rule) with measured
sizes: the saved tensors of the forward (``profile/stash.py``), the kept input of a
recomputed micro-batch, the gradients a pending W keeps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.results import ResultChannel
from lightning_dapple.execute.groups import PlanGroups
from lightning_dapple.execute.recompute import (
    WeightWork,
    discard_saved,
    frozen_buffers,
    output_edges,
    reseed,
    restore_rng,
    save_rng,
    tensor_bytes,
    tensor_leaves,
    weight_groups,
    weight_work,
)
from lightning_dapple.execute.slicing import batch_size_of, flatten, slice_rows, take_rows
from lightning_dapple.execute.transport import Peer, Transport, receives_ahead_pay
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.stash import StashMeter, parameter_storages
from lightning_dapple.schedule.actions import Kind
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
    # split backward: per weight group, its W pieces and (after B) their gradients
    edges: list[list[WeightWork]] | None = None
    wgrads: list[list[list[torch.Tensor] | None]] | None = None
    w_left: set[int] = field(default_factory=set)
    w_todo: int = 0
    input_grads: list[torch.Tensor] | None = None
    sent: bool = False


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
        self.transport = Transport(failure, device)
        self.results = ResultChannel(plan, rank, device, failure)
        # post each receive one transfer ahead (None: where that pays, see receives_ahead_pay)
        self.post_ahead = receives_ahead_pay(device) if post_ahead is None else post_ahead
        self.groups = groups
        self.replica_groups = groups.replicas
        self.loss_reduction = loss_reduction
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.num_stages - 1
        self.stats = StageStats()
        self.parameters = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
        # stash measurement: parameter storages to leave out while a forward is measured
        # (None: not measuring), per-layer stashed bytes by input layout, the last total
        self._measure: set[int] | None = None
        self._layer_stash: dict[Any, list[int]] = {}
        self._last_stash = 0
        # out-of-order backprop and recomputation
        compute = schedule.compute(self.stage) if self.stage < schedule.num_stages else []
        any_w = any(a.kind is Kind.W for acts in schedule.actions for a in acts)
        self.split = any(a.kind is Kind.W for a in compute) or (schedule.split_backward and not any_w)
        self.recomputed = schedule.recomputed(self.stage) if self.stage < schedule.num_stages else frozenset()
        self._w_groups = weight_groups(self.layers)
        self._group_params = [self._unique_params(a, b) for a, b in self._w_groups]
        self._group_ends = {b - 1: index for index, (a, b) in enumerate(self._w_groups)}
        self._group_starts = {a: index for index, (a, b) in enumerate(self._w_groups)}
        self._buffers = [buffer for layer in self.layers for buffer in layer.buffers()]
        owner: dict[int, int] = {}
        for index, layer in enumerate(self.layers):
            for param in layer.parameters():
                if param.requires_grad:
                    owner.setdefault(id(param), index)
        self._param_owner = owner
        self._edge_sink: list[list[WeightWork]] | None = None
        self._steps = 0
        self._base_seed = torch.initial_seed()
        # positions of this stage's receive actions (what ``_post_ahead`` looks for)
        own = schedule.actions[self.stage] if self.stage < schedule.num_stages else []
        self._receive_positions = [i for i, a in enumerate(own) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
        # per receive position: the earlier sends it waits for too (schedule/settle.py);
        # settle_sends=False leaves every send to the end of the step (the benchmarks' ablation)
        self._settle_at = (
            settle_points(schedule.actions)[self.stage] if settle_sends and self.stage < schedule.num_stages else {}
        )
        self._peer_cache: dict[tuple[int, int, int], list[Peer]] = {}
        self._w_count: dict[int, int] = {}
        for action in compute:
            if action.kind is Kind.W and action.microbatch is not None:
                self._w_count[action.microbatch] = self._w_count.get(action.microbatch, 0) + 1

    def _unique_params(self, start: int, end: int) -> list[torch.nn.Parameter]:
        out, seen = [], set()
        for layer in self.layers[start:end]:
            for param in layer.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    out.append(param)
        return out

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

    def run_layers(self, x: Any) -> Any:
        """Apply the stage's layers.

        While a forward is measured (``self._measure``), count what each layer stashes (the
        layers only: the loss's own saves are not in any profile) into ``_last_stash``.
        Saved-tensor hooks cost Python work on every saved tensor, which small stages feel
        (DAPPLE 5.2: per-micro-batch overhead is the pipeline's enemy), so each layer is
        measured once per input layout (shapes, dtypes, requires_grad) and the sizes are
        reused afterwards: what a layer saves depends on its input's layout, not its values.
        While a split-backward forward records, find where each weight group's W starts
        (``execute.recompute.weight_work``)."""
        exclude = self._measure
        sink = self._edge_sink
        if exclude is None and sink is None:
            for layer in self.layers:
                x = layer(x)
            return x
        key = (self.layers[0].training, _layout_key(x)) if exclude is not None and self.layers else None
        known = self._layer_stash.get(key) if key is not None else None
        meter = StashMeter(exclude) if exclude is not None and known is None else None
        hooks = torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter is not None else _null()
        measured: list[int] = []
        inputs: list[Any] = []
        running = at_group_start = 0
        with hooks:
            for index, layer in enumerate(self.layers):
                if sink is not None and index in self._group_starts:
                    inputs = output_edges(x)
                    at_group_start = running
                before = 0
                if meter is not None:
                    meter.next_layer()
                    before = meter.bytes
                x = layer(x)
                if meter is not None:
                    measured.append(meter.bytes - before)
                running += measured[-1] if meter is not None else (known[index] if known is not None else 0)
                if sink is not None and index in self._group_ends:
                    group = self._group_ends[index]
                    outputs = output_edges(x)
                    limit = max(_grad_bytes(x), running - at_group_start)
                    sink.append(weight_work(outputs, inputs, self._group_params[group], limit))
        if meter is not None:
            self._layer_stash[key] = measured
        self._last_stash = running
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
        return hash((self._base_seed, self._steps, self.stage, self.replica, microbatch)) & 0x7FFF_FFFF_FFFF_FFFF

    # -- stash accounting (schedule.ooo.stash_walk with measured sizes) ----------
    def _hold(self, mb: int, nbytes: int) -> None:
        self._held[mb] = self._held.get(mb, 0) + nbytes
        self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, sum(self._held.values()))

    def _drop(self, mb: int) -> None:
        self._held.pop(mb, None)

    # -- training ----------------------------------------------------------------
    def train_step(
        self, batch: Any, callbacks: StageCallbacks, extras: Callable[[], Any] | None = None
    ) -> tuple[torch.Tensor, list[Any]]:
        """Run one optimizer step's forward/backward work; gradients are left in ``.grad``.

        Returns the loss of the whole global batch (the same on every rank) and the list
        of what ``extras()`` returned on each last-stage replica (on every rank).
        """
        batch_rows = batch_size_of(batch)
        self.check_batch(batch_rows)
        for param in self.parameters:
            param.grad = None
        self.stats = StageStats()
        self._held: dict[int, int] = {}
        self._buckets: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter]]] = []
        exclude = parameter_storages(self.parameters)
        state: dict[int, _MicroBatch] = {}
        losses: list[torch.Tensor] = []  # last stage: each micro-batch's weighted loss, summed once at the end
        allreduce: tuple[Any, torch.Tensor] | None = None
        clock = time.perf_counter
        actions = self.schedule.actions[self.stage]
        receives = self._receive_positions
        upcoming = 0  # index into ``receives`` of the first receive not yet executed
        self.results.post()
        rng = save_rng(self.device)  # every F reseeds; the caller's RNG stream is put back when the step ends
        self._base_seed = torch.initial_seed()  # before any reseed changes what initial_seed() answers
        try:
            for position, action in enumerate(actions):
                mb = action.microbatch
                kind = action.kind
                if self.post_ahead and kind in (Kind.F, Kind.B, Kind.W):
                    while upcoming < len(receives) and receives[upcoming] < position:
                        upcoming += 1
                    if upcoming < len(receives):
                        self._post_ahead(actions[receives[upcoming]], state, batch_rows)
                if kind is Kind.RECV_ACT:
                    assert mb is not None
                    rows = self._rows(self.stage, self.replica, batch_rows, mb)
                    inputs = self.transport.recv_activation(rows, self._peers(self.stage - 1, batch_rows, mb), f"activation {mb}")
                    state[mb] = _MicroBatch(rows=rows, inputs=inputs)
                    self.transport.settle(self._settle_at.get(position))
                elif kind is Kind.F:
                    assert mb is not None
                    start = clock()
                    item = state.get(mb)
                    if item is None:
                        item = state[mb] = _MicroBatch(rows=self._rows(self.stage, self.replica, batch_rows, mb))
                    recompute = mb in self.recomputed
                    self._measure = None if recompute else exclude
                    self._last_stash = 0
                    if self.split and not recompute:
                        item.edges = []
                        self._edge_sink = item.edges
                    try:
                        reseed(self._seed(mb), self.device)
                        self._forward(item, take_rows(batch, *item.rows), callbacks, batch_rows, recompute)
                    finally:
                        self._measure = None
                        self._edge_sink = None
                    if self.is_last and item.loss is not None:
                        losses.append(item.loss.detach())
                    stashed = tensor_bytes(item.inputs) if recompute else self._last_stash
                    self.stats.stash_bytes[mb] = stashed
                    self._hold(mb, stashed)
                    self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self._held))
                    self.stats.timeline.append((start, clock(), "F", mb))
                elif kind is Kind.SEND_ACT:
                    assert mb is not None
                    item = state[mb]
                    self.transport.send_activation(
                        item.outputs, item.rows, self._peers(self.stage + 1, batch_rows, mb), f"activation {mb}", (kind, mb)
                    )
                elif kind is Kind.RECV_GRAD:
                    assert mb is not None
                    item = state[mb]
                    like = [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]
                    grads = self.transport.recv_gradient(like, item.rows, self._peers(self.stage + 1, batch_rows, mb), f"gradient {mb}")
                    item.outputs = (like, grads)
                    self.transport.settle(self._settle_at.get(position))
                elif kind is Kind.B:
                    assert mb is not None
                    start = clock()
                    item = state[mb]
                    self._backward(mb, item, exclude)
                    self.stats.timeline.append((start, clock(), "B", mb))
                    if self.is_first:
                        item.sent = True
                    self._release(state, mb)
                elif kind is Kind.SEND_GRAD:
                    assert mb is not None
                    item = state[mb]
                    grads = item.input_grads
                    if grads is None:
                        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in self._grad_inputs(item)]
                    self.transport.send_gradient(grads, item.rows, self._peers(self.stage - 1, batch_rows, mb), f"gradient {mb}", (kind, mb))
                    item.input_grads = None
                    item.sent = True
                    self._release(state, mb)
                elif kind is Kind.W:
                    assert mb is not None
                    start = clock()
                    item = state[mb]
                    item.w_todo -= 1
                    self._weight_work(item, action.layers if item.w_todo > 0 else None)
                    self.stats.timeline.append((start, clock(), "W", mb))
                    if item.w_todo <= 0:
                        self._drop(mb)
                        self._release(state, mb)
                elif kind is Kind.ALLREDUCE and action.layers is not None:
                    self._start_bucket(action.layers)
                elif kind is Kind.ALLREDUCE:
                    allreduce = self._start_allreduce()
                else:
                    raise NotImplementedError(f"action {action} is not supported by this executor")
            self.transport.flush()
            if allreduce is not None:
                self._finish_allreduce(*allreduce)
            self._finish_buckets()
        finally:
            restore_rng(rng)
            self._steps += 1
        loss_sum = torch.stack(losses).to(torch.float64).sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        loss, shared = self.results.share(loss_sum, extras() if (extras is not None and self.is_last) else None)
        assert loss is not None
        return loss, shared

    def _post_ahead(self, action: Any, state: dict[int, "_MicroBatch"], batch_rows: int) -> None:
        """Post the receives of the next receive action before this compute runs, so its
        data arrives meanwhile (one transfer ahead, in action order: see transport)."""
        mb = action.microbatch
        what = f"{'activation' if action.kind is Kind.RECV_ACT else 'gradient'} {mb}"
        if self.transport.is_posted(what):
            return
        if action.kind is Kind.RECV_ACT:
            rows = self._rows(self.stage, self.replica, batch_rows, mb)
            self.transport.post_activation(rows, self._peers(self.stage - 1, batch_rows, mb), what)
            return
        item = state.get(mb)
        if item is None or item.outputs is None:
            return  # its forward has not run yet: sizes unknown
        like = [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]
        self.transport.post_gradient(like, item.rows, self._peers(self.stage + 1, batch_rows, mb), what)

    def _release(self, state: dict[int, "_MicroBatch"], mb: int) -> None:
        item = state.get(mb)
        if item is not None and item.sent and item.w_todo <= 0 and item.outputs is None:
            state.pop(mb)

    # -- forward -----------------------------------------------------------------
    def _forward(self, item: _MicroBatch, batch_slice: Any, callbacks: StageCallbacks, batch_rows: int, recompute: bool) -> None:
        if not self.is_last:
            x = callbacks.make_input(batch_slice) if self.is_first else item.inputs
            if recompute:
                item.inputs = x
                with discard_saved():
                    item.outputs = _detached(self.run_layers(x))
            else:
                item.outputs = self.run_layers(x)
            return
        received = item.inputs

        def forward(*args: Any, **kwargs: Any) -> Any:
            x = (args[0] if len(args) == 1 else args) if self.is_first else received
            if not recompute:
                return self.run_layers(x)
            item.inputs = x
            with discard_saved():
                y = _detached(self.run_layers(x))
            item.y = [leaf for leaf in tensor_leaves(y) if leaf.requires_grad]
            return y

        loss = callbacks.compute_loss(batch_slice, forward)
        weight = (item.rows[1] - item.rows[0]) / batch_rows if self.loss_reduction == "mean" else 1.0
        item.loss = loss * weight

    def _recompute(self, mb: int, item: _MicroBatch, exclude: set[int]) -> Any:
        """Replay the stage forward of ``mb`` with autograd (same seed, buffers kept) and
        hold what it stashes; returns the stage output with its graph."""
        self._measure = exclude
        self._last_stash = 0
        if self.split:
            item.edges = []
            self._edge_sink = item.edges
        try:
            reseed(self._seed(mb), self.device)  # the step restores the caller's RNG state
            with frozen_buffers(self._buffers):
                outputs = self.run_layers(item.inputs)
        finally:
            self._measure = None
            self._edge_sink = None
        self.stats.recomputed += 1
        self._hold(mb, self._last_stash)
        return outputs

    def _grad_inputs(self, item: _MicroBatch) -> list[torch.Tensor]:
        return [leaf for leaf in flatten(item.inputs)[0] if leaf.requires_grad]

    # -- backward ------------------------------------------------------------------
    def _roots(self, mb: int, item: _MicroBatch, exclude: set[int]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
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
        replayed = [leaf for leaf in tensor_leaves(self._recompute(mb, item, exclude)) if leaf.requires_grad]
        if len(replayed) != len(like):
            raise RuntimeError(
                f"stage {self.stage}: the recomputed forward of micro-batch {mb} has {len(replayed)} outputs that require grad, "
                f"the original had {len(like)}; recomputation needs a forward that depends only on its input and the RNG"
            )
        return replayed, list(grads)

    def _backward(self, mb: int, item: _MicroBatch, exclude: set[int]) -> None:
        roots, root_grads = self._roots(mb, item, exclude)
        item.loss = None
        item.y = None
        if not self.split:
            if roots:
                torch.autograd.backward(roots, root_grads)
            item.outputs = None
            self._drop(mb)
            return
        self._backward_input(mb, item, roots, root_grads)
        item.outputs = None

    def _backward_input(self, mb: int, item: _MicroBatch, roots: list[torch.Tensor], root_grads: list[torch.Tensor] | None) -> None:
        """B of out-of-order backprop: the gradients of the stage input and those W starts
        from (each weight group's frontier, ``execute.recompute.weight_work``), in one pass
        over a graph that is kept for W."""
        from torch.autograd.graph import get_gradient_edge

        groups = item.edges or []
        known: dict[tuple[int, int], torch.Tensor] = {}
        if root_grads is not None:
            for root, grad in zip(roots, root_grads):
                edge = get_gradient_edge(root)
                known[(id(edge.node), edge.output_nr)] = grad
        inputs = self._grad_inputs(item) if not self.is_first else []
        targets: list[Any] = [get_gradient_edge(leaf) for leaf in inputs]
        wanted: dict[tuple[int, int], int] = {}
        for pieces in groups:
            for piece in pieces:
                for edge in piece.edges:
                    key = (id(edge.node), edge.output_nr)
                    if key not in known and key not in wanted:
                        wanted[key] = len(targets)
                        targets.append(edge)
        results: Sequence[torch.Tensor | None] = ()
        if roots and targets:
            results = torch.autograd.grad(roots, targets, root_grads, retain_graph=bool(groups), allow_unused=True)
        if inputs:
            item.input_grads = [
                results[i] if results and results[i] is not None else torch.zeros_like(x) for i, x in enumerate(inputs)
            ]
        kept: list[list[list[torch.Tensor] | None]] = []
        kept_work: list[list[WeightWork]] = []
        held = 0
        seen: set[int] = set()
        for pieces in groups:
            group_work, group_grads = [], []
            for piece in pieces:
                pairs = []
                for edge in piece.edges:
                    key = (id(edge.node), edge.output_nr)
                    grad = known.get(key)
                    if grad is None and key in wanted:
                        grad = results[wanted[key]] if results else None
                    if grad is not None:
                        pairs.append((edge, grad))
                        if id(grad) not in seen:
                            seen.add(id(grad))
                            held += grad.numel() * grad.element_size()
                group_work.append(WeightWork([edge for edge, _ in pairs], piece.params))
                group_grads.append([grad for _, grad in pairs] if pairs else None)
            kept_work.append(group_work)
            kept.append(group_grads)
        item.edges = kept_work
        item.wgrads = kept
        item.w_left = set(range(len(self._w_groups))) if groups else set()
        item.w_todo = self._w_count.get(mb, 0)
        if item.w_todo > 0:
            self._hold(mb, held)
        else:  # no W scheduled for it: do the weight work now
            self._weight_work(item, None)
            self._drop(mb)

    def _weight_work(self, item: _MicroBatch, layers: tuple[int, int] | None) -> None:
        """W: weight gradients of the groups still owed (those meeting ``layers``), from
        the last layer back, each freeing its part of the graph."""
        if item.edges is None or item.wgrads is None:
            item.w_left = set()
            return
        order = sorted(item.w_left, reverse=True)
        if layers is not None:
            order = [g for g in order if self._w_groups[g][0] < layers[1] and self._w_groups[g][1] > layers[0]]
        for group in order:
            item.w_left.discard(group)
            pieces, grads_of = item.edges[group], item.wgrads[group]
            item.edges[group] = []
            item.wgrads[group] = []
            for piece, grads in zip(pieces, grads_of):
                if not grads or not piece.params:
                    continue
                # the graph stays until the group's pieces are dropped (pieces may share nodes)
                results = torch.autograd.grad(piece.edges, piece.params, grads, retain_graph=True, allow_unused=True)
                for param, grad in zip(piece.params, results):
                    if grad is None:
                        continue
                    if param.grad is None:  # like AccumulateGrad: keep it when its layout is the parameter's
                        param.grad = grad if grad.stride() == param.stride() else grad.clone(memory_format=torch.contiguous_format)
                    else:
                        param.grad += grad
            del pieces, grads_of
        if not item.w_left:
            item.edges = None
            item.wgrads = None

    # -- gradient AllReduce --------------------------------------------------------
    def _start_bucket(self, layers: tuple[int, int]) -> None:
        """Asynchronous AllReduce of the gradients of ``layers`` (their W is complete)."""
        group = self.replica_groups.get(self.stage)
        if group is None:
            return
        params, seen = [], set()
        for param in self.parameters:
            if id(param) not in seen and layers[0] <= self._param_owner[id(param)] < layers[1]:
                seen.add(id(param))
                params.append(param)
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._buckets.append((dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat, params))

    def _finish_buckets(self) -> None:
        buckets, self._buckets = self._buckets, []
        for work, flat, params in buckets:
            self.failure.wait(work, f"gradient AllReduce bucket of stage {self.stage}")
            offset = 0
            for param in params:
                count = param.numel()
                param.grad = flat[offset : offset + count].view_as(param).clone()
                offset += count

    def _start_allreduce(self) -> tuple[Any, torch.Tensor] | None:
        group = self.replica_groups.get(self.stage)
        if group is None or not self.parameters:
            return None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        flat = torch.cat([g.reshape(-1) for g in grads])
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat

    def _finish_allreduce(self, work: Any, flat: torch.Tensor) -> None:
        self.failure.wait(work, f"gradient AllReduce of stage {self.stage}")
        offset = 0
        for param in self.parameters:
            count = param.numel()
            param.grad = flat[offset : offset + count].view_as(param).clone()
            offset += count

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
        with torch.no_grad():
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


def _layout_key(value: Any) -> tuple:
    """What decides the tensors a forward saves: the layout of its input, not its values."""
    leaves = [value] if type(value) is torch.Tensor else tensor_leaves(value)
    return (torch.is_grad_enabled(), *((tuple(t.shape), t.dtype, t.requires_grad, t.device) for t in leaves))


def _grad_bytes(value: Any) -> int:
    """Bytes of the tensors of ``value`` that require grad (their gradients' size)."""
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value) if t.requires_grad)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _detached(value: Any) -> Any:
    """``value`` with every tensor detached, keeping which of them require grad."""
    from torch.utils import _pytree as pytree

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad)
        return leaf

    return pytree.tree_map(cut, value)
