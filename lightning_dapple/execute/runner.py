"""Interpreter of a schedule's action list on one rank: the multi-process executor.

The runner owns nothing but the rank's own stage layers and walks the action list built
by ``lightning_dapple.schedule`` (the same list the simulator times):

* F: run the stage's layers on one micro-batch slice (the first stage takes it from the
  batch via ``make_input``; the last computes the loss via ``compute_loss``), stashing
  what backward needs (DAPPLE 3.2: at most K_i micro-batches in flight);
* B: backpropagate that micro-batch, accumulating parameter gradients (5.2.3: "each
  device produces and accumulates gradients for all micro-batches");
* send/receive: split-concat transfers to adjacent stages (5.2.2);
* ALLREDUCE: sum the accumulated gradients among the stage's replicas, started as soon as
  the stage's last backward is done and waited at the end of the step.

Losses are weighted by (slice rows / global batch rows) for mean-reduced losses, so the
accumulated gradients are exactly those of one device on the whole global batch.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.groups import PlanGroups
from lightning_dapple.execute.slicing import batch_size_of, flatten, slice_rows, take_rows
from lightning_dapple.execute.transport import Peer, Transport
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.stash import StashMeter, parameter_storages
from lightning_dapple.schedule.actions import Kind
from lightning_dapple.schedule.builders import Schedule


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
    """What the executor measured on this rank during the last step."""

    peak_in_flight: int = 0
    peak_stash_bytes: int = 0
    stash_bytes: dict[int, int] = field(default_factory=dict)
    timeline: list[tuple[float, float, str, int]] = field(default_factory=list)


@dataclass
class _MicroBatch:
    rows: tuple[int, int]
    inputs: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None


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
        self.groups = groups
        self.replica_groups = groups.replicas
        self.loss_reduction = loss_reduction
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.num_stages - 1
        self.stats = StageStats()
        self.parameters = [p for layer in self.layers for p in layer.parameters() if p.requires_grad]
        self._counter: StashMeter | None = None

    # -- helpers ---------------------------------------------------------------
    def _rows(self, stage: int, replica: int, batch_rows: int, microbatch: int) -> tuple[int, int]:
        return slice_rows(batch_rows, self.plan.micro_batches, microbatch, self.plan.stages[stage].replicas, replica)

    def _peers(self, stage: int, batch_rows: int, microbatch: int) -> list[Peer]:
        devices = self.plan.stages[stage].devices
        return [Peer(rank, self._rows(stage, index, batch_rows, microbatch)) for index, rank in enumerate(devices)]

    def run_layers(self, x: Any) -> Any:
        """Apply the stage's layers; while a forward is being measured, count what each
        layer stashes (the layers only: the loss's own saves are not in any profile)."""
        meter = self._counter
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
        exclude = parameter_storages(self.parameters)
        state: dict[int, _MicroBatch] = {}
        in_flight: set[int] = set()
        loss_sum = torch.zeros((), dtype=torch.float64)
        allreduce: tuple[Any, torch.Tensor] | None = None
        clock = time.perf_counter
        for action in self.schedule.actions[self.stage]:
            mb = action.microbatch
            kind = action.kind
            if kind is Kind.RECV_ACT:
                assert mb is not None
                rows = self._rows(self.stage, self.replica, batch_rows, mb)
                inputs = self.transport.recv_activation(rows, self._peers(self.stage - 1, batch_rows, mb), f"activation {mb}")
                state[mb] = _MicroBatch(rows=rows, inputs=inputs)
            elif kind is Kind.F:
                assert mb is not None
                start = clock()
                item = state.setdefault(mb, _MicroBatch(rows=self._rows(self.stage, self.replica, batch_rows, mb)))
                counter = self._counter = StashMeter(exclude)
                try:
                    self._forward(item, take_rows(batch, *item.rows), callbacks, batch_rows)
                finally:
                    self._counter = None
                if self.is_last and item.loss is not None:
                    loss_sum += item.loss.detach().to(torch.float64).cpu()
                in_flight.add(mb)
                self.stats.stash_bytes[mb] = counter.bytes
                self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(in_flight))
                self.stats.peak_stash_bytes = max(self.stats.peak_stash_bytes, sum(self.stats.stash_bytes[m] for m in in_flight))
                self.stats.timeline.append((start, clock(), "F", mb))
            elif kind is Kind.SEND_ACT:
                assert mb is not None
                item = state[mb]
                self.transport.send_activation(item.outputs, item.rows, self._peers(self.stage + 1, batch_rows, mb), f"activation {mb}")
            elif kind is Kind.RECV_GRAD:
                assert mb is not None
                item = state[mb]
                like = [leaf for leaf in flatten(item.outputs)[0] if leaf.requires_grad]
                grads = self.transport.recv_gradient(like, item.rows, self._peers(self.stage + 1, batch_rows, mb), f"gradient {mb}")
                item.outputs = (like, grads)
            elif kind is Kind.B:
                assert mb is not None
                start = clock()
                self._backward(state[mb])
                in_flight.discard(mb)
                self.stats.timeline.append((start, clock(), "B", mb))
            elif kind is Kind.SEND_GRAD:
                assert mb is not None
                item = state[mb]
                grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in self._grad_inputs(item)]
                self.transport.send_gradient(grads, item.rows, self._peers(self.stage - 1, batch_rows, mb), f"gradient {mb}")
                state.pop(mb)
            elif kind is Kind.ALLREDUCE:
                allreduce = self._start_allreduce()
            else:
                raise NotImplementedError(f"action {action} is not supported by this executor")
            if kind is Kind.B and self.is_first:
                state.pop(mb, None)
        self.transport.flush()
        if allreduce is not None:
            self._finish_allreduce(*allreduce)
        loss = self._share_loss(loss_sum)
        shared = self._share_extras(extras() if (extras is not None and self.is_last) else None)
        return loss, shared

    def _forward(self, item: _MicroBatch, batch_slice: Any, callbacks: StageCallbacks, batch_rows: int) -> None:
        if self.is_first and not self.is_last:
            item.outputs = self.run_layers(callbacks.make_input(batch_slice))
            return
        if not self.is_last:
            item.outputs = self.run_layers(item.inputs)
            return
        received = item.inputs

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.is_first:
                return self.run_layers(args[0] if len(args) == 1 else args)
            return self.run_layers(received)

        loss = callbacks.compute_loss(batch_slice, forward)
        weight = (item.rows[1] - item.rows[0]) / batch_rows if self.loss_reduction == "mean" else 1.0
        item.loss = loss * weight

    def _grad_inputs(self, item: _MicroBatch) -> list[torch.Tensor]:
        return [leaf for leaf in flatten(item.inputs)[0] if leaf.requires_grad]

    def _backward(self, item: _MicroBatch) -> None:
        if self.is_last:
            assert item.loss is not None
            item.loss.backward()
            item.loss = None
        else:
            outputs, grads = item.outputs
            if outputs:
                torch.autograd.backward(outputs, grads)
        item.outputs = None

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

    def _share_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        last = self.plan.stages[-1]
        group = self.replica_groups.get(self.plan.num_stages - 1)
        if self.is_last and group is not None:
            self.failure.wait(dist.all_reduce(loss_sum, group=group, async_op=True), "loss reduction")
        if self.plan.world_size > 1:
            self.failure.wait(dist.broadcast(loss_sum, src=last.devices[0], group=self.groups.plan, async_op=True), "loss broadcast")
        return loss_sum

    def _share_extras(self, obj: Any) -> list[Any]:
        """Objects of every last-stage replica (in replica order), on every rank of the plan."""
        last = self.plan.stages[-1]
        src = last.devices[0]
        gathered: list[Any] | None = None
        if self.is_last:
            if self.rank == src:
                gathered = [obj] + [self._recv_object(peer, "results of the last stage") for peer in last.devices[1:]]
            else:
                self._send_object(obj, src, "results of the last stage")
        if self.plan.world_size == 1:
            return gathered or [obj]
        return self._broadcast_object(gathered, src)

    def _send_object(self, obj: Any, dst: int, what: str) -> None:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.failure.wait(dist.isend(size, dst), what)
        self.failure.wait(dist.isend(payload, dst), what)

    def _recv_object(self, src: int, what: str) -> Any:
        size = torch.zeros(1, dtype=torch.int64)
        self.failure.wait(dist.irecv(size, src), what)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.failure.wait(dist.irecv(payload, src), what)
        return pickle.loads(payload.numpy().tobytes())

    def _broadcast_object(self, obj: Any, src: int) -> Any:
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.failure.wait(dist.broadcast(size, src=src, group=self.groups.plan, async_op=True), "result broadcast")
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.failure.wait(dist.broadcast(payload, src=src, group=self.groups.plan, async_op=True), "result broadcast")
        return pickle.loads(payload.numpy().tobytes()) if self.rank != src else obj

    # -- forward only (validation, test, predict) -------------------------------
    def forward_step(self, batch: Any, callbacks: "EvalCallbacks") -> list[Any]:
        """GPipe-style forward of every micro-batch; returns the last stage's per-slice
        results ordered by (micro-batch, replica), on every rank."""
        batch_rows = batch_size_of(batch)
        self.check_batch(batch_rows)
        results: list[Any] = []
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
        gathered = self._share_extras(results if self.is_last else None)
        replicas = self.plan.stages[-1].replicas
        return [gathered[replica][mb] for mb in range(self.plan.micro_batches) for replica in range(replicas)]
