"""BatchNorm on a pipeline: what normalises a micro-batch, and when running statistics move.

A stage replicated r ways sees each micro-batch as r slices, one per replica, and sees the
global batch as M micro-batches (DAPPLE 5.2.2). Plain ``nn.BatchNorm`` then normalises each
slice by itself and updates its running statistics once per slice, on each replica apart.
GPipe 2.2 names the two things a pipeline should do instead: normalise over the
micro-batch, "over replicas if necessary", and track the moving averages "over the entire
mini-batch". Three pieces, chosen once per plan:

* ``PipelineBatchNorm`` replaces a BatchNorm module of a stage:

  - with ``sync`` (``Trainer(sync_batchnorm=True)``; Lightning's DDP uses
    ``nn.SyncBatchNorm``, which refuses CPU tensors in this torch) each micro-batch is
    normalised with the mean and variance of the whole micro-batch across the stage's
    replicas. Every replica puts its slice's (mean, variance, count) in its own row of a
    zero table that one AllReduce sums (``_SumOverReplicas``, whose backward is the
    AllReduce of the replicas' gradients), and combines the rows in replica order (Chan's
    parallel variance), so the statistics are bit-identical on every replica and their
    gradient is exactly that of one device on the whole micro-batch. Both AllReduces are
    waited for through the stage's failure channel (``ReplicaWaits``): a replica that failed
    ends the others within the channel's grace, not the process group's timeout;
  - with ``deferred`` (torchgpipe's DeferredBatchNorm) each micro-batch is still normalised
    with its own statistics, but the running statistics are not touched in the forward:
    each forward's (count, mean, M2) is merged into accumulator buffers, and
    ``StageBuffers.end_step`` updates running mean, unbiased variance and
    ``num_batches_tracked`` once, from the whole global batch (all micro-batches, all
    replicas), as one device that saw it would.

  The accumulators are buffers on purpose: a recomputed micro-batch's replay runs on scratch
  copies of every buffer of the stage (``replay.scratch_buffers``), so it counts nothing twice.
* ``convert_batchnorm`` swaps the modules in, sharing the originals' parameters and buffers
  (state-dict keys unchanged, so checkpoints load into the plain module).
* ``StageBuffers.end_step`` runs where the runner's step ends: the deferred update, then
  every other buffer of the stage broadcast from the stage's first replica (torch DDP's
  ``broadcast_buffers``), so replicas never diverge and the checkpoint, written by that
  replica, holds what every replica evaluates with.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.replay import buffer_slots
from lightning_dapple.execute.transfer.wires import waits_on_device

__all__ = ["PipelineBatchNorm", "StageBuffers", "convert_batchnorm"]

_ACCUMULATORS = ("deferred_count", "deferred_mean", "deferred_m2")


class PipelineBatchNorm(_BatchNorm):
    """A BatchNorm of one stage: statistics over the stage's replicas (``group`` given) and/or
    running statistics deferred to the end of the step (see the module docstring).

    Made by ``convert_batchnorm`` from an existing module, whose parameters and running
    buffers it shares; ``replica`` is this rank's row in the statistics table of ``replicas``.
    """

    def __init__(self, original: _BatchNorm, group: Any, replica: int, replicas: int, deferred: bool) -> None:
        super().__init__(
            original.num_features, original.eps, original.momentum, original.affine, original.track_running_stats, device="meta"
        )
        self.weight, self.bias = original.weight, original.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self._buffers[name] = original._buffers.get(name)
        self.training = original.training
        self._check_dims = type(original)._check_input_dim
        self.group = group
        self.replica = replica
        self.replicas = replicas
        self.deferred = deferred and self.track_running_stats
        self.waits = ReplicaWaits(group, None)  # the stage's failure channel, given by StageBuffers
        if self.deferred:
            device = original.running_mean.device  # type: ignore[union-attr]
            zeros = {"dtype": torch.float64, "device": device}
            self.register_buffer("deferred_count", torch.zeros((), **zeros), persistent=False)
            self.register_buffer("deferred_mean", torch.zeros(self.num_features, **zeros), persistent=False)
            self.register_buffer("deferred_m2", torch.zeros(self.num_features, **zeros), persistent=False)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._check_dims(self, input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sync={self.group is not None}, deferred={self.deferred}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or (self.group is None and not self.deferred):
            # evaluation, or a user's nn.SyncBatchNorm on an unreplicated stage: plain BatchNorm
            return super().forward(input)
        self._check_input_dim(input)
        if self.group is None:  # deferred only: this slice's statistics, running ones untouched here
            output = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
            with torch.no_grad():
                data = _statistics_dtype(input)
                variance, mean = torch.var_mean(data, dim=_reduced_dims(data), correction=0)
                self._accumulate(mean, variance, input.numel() / input.shape[1])
            return output
        mean, variance, count = self._replica_statistics(input)
        if self.deferred:
            with torch.no_grad():
                self._accumulate(mean, variance, count)
        elif self.track_running_stats:
            with torch.no_grad():
                _update_running(self, mean, variance * count, count)
        return _normalise(input, mean, variance, self.weight, self.bias, self.eps)

    def _replica_statistics(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, biased variance and count of the whole micro-batch across the replicas
        (differentiable: the AllReduce's backward sums the replicas' gradients)."""
        data = _statistics_dtype(input)
        variance, mean = torch.var_mean(data, dim=_reduced_dims(data), correction=0)
        row = torch.cat([mean, variance, mean.new_full((1,), input.numel() / input.shape[1])])
        table = F.pad(row.unsqueeze(0), (0, 0, self.replica, self.replicas - 1 - self.replica))  # this replica's row, zeros elsewhere
        table = _SumOverReplicas.apply(table, self.waits)
        channels = self.num_features
        counts = table[:, 2 * channels :]
        total = counts.sum()
        weights = counts / total
        means = table[:, :channels]
        mean = (weights * means).sum(0)
        variance = (weights * (table[:, channels : 2 * channels] + (means - mean) ** 2)).sum(0)
        return mean, variance, total

    def _accumulate(self, mean: torch.Tensor, variance: torch.Tensor, count: Any) -> None:
        """Merge one forward's statistics into the step's (Chan et al.'s pairwise update)."""
        merge_statistics(self.deferred_count, self.deferred_mean, self.deferred_m2, mean, variance * count, count)

    def reset_accumulators(self) -> None:
        for name in _ACCUMULATORS:
            self._buffers[name].zero_()  # type: ignore[union-attr]


class ReplicaWaits:
    """Sum a tensor over a stage's replica group and wait for it as the failure channel
    waits: on the GPU under NCCL (the compute stream waits, the watchdog bounds it), on the
    host under gloo (bounded, a peer's failure raised). Without a channel (BatchNorm
    converted outside a runner), a plain wait."""

    def __init__(self, group: Any, failure: FailureChannel | None) -> None:
        self.group = group
        self.failure = failure
        self._on_device: dict[torch.device, bool] = {}  # per device: waits on the GPU (NCCL)

    def wait(self, works: list[Any], device: torch.device, what: str) -> None:
        if self.failure is None:
            for work in works:
                work.wait()
            return
        on_device = self._on_device.get(device)
        if on_device is None:
            on_device = self._on_device[device] = waits_on_device(device, self.group)
        if on_device:
            self.failure.wait_on_device(works, what, device.index)
        else:
            self.failure.wait_all(works, what)

    def sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor`` (contiguous, owned by the caller) summed in place over the group."""
        self.wait([dist.all_reduce(tensor, group=self.group, async_op=True)], tensor.device, what)
        return tensor


class _SumOverReplicas(torch.autograd.Function):
    """The replicas' statistics tables summed; the backward sums the gradients the same way
    (each replica's loss reads the sum, so each row's gradient is the sum over replicas)."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, waits: ReplicaWaits) -> torch.Tensor:
        ctx.waits = waits
        return waits.sum(table.contiguous().clone(), "BatchNorm statistics across replicas")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.waits.sum(grad.contiguous().clone(), "BatchNorm statistics' gradient across replicas"), None


def _reduced_dims(input: torch.Tensor) -> list[int]:
    return [0, *range(2, input.dim())]


def _statistics_dtype(input: torch.Tensor) -> torch.Tensor:
    """Statistics of half-precision inputs in float32, as ``nn.SyncBatchNorm`` computes them."""
    return input.float() if input.dtype in (torch.float16, torch.bfloat16) else input


def _normalise(input: torch.Tensor, mean: torch.Tensor, variance: torch.Tensor, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    shape = [1, -1] + [1] * (input.dim() - 2)
    output = (input - mean.view(shape)) * torch.rsqrt(variance.view(shape) + eps)
    if weight is not None:
        output = output * weight.view(shape) + bias.view(shape)
    return output.to(input.dtype)


def merge_statistics(count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, new_mean: torch.Tensor, new_m2: torch.Tensor, new_count: Any) -> None:
    """Fold a set of ``new_count`` values (mean, sum of squared deviations) into the running
    (count, mean, m2) in place: Chan, Golub and LeVeque's update, stable where sums of
    squares are not."""
    total = count + new_count
    delta = new_mean.to(mean.dtype) - mean
    share = new_count / total.clamp(min=1)
    mean.add_(delta * share)
    m2.add_(new_m2.to(m2.dtype) + delta * delta * (count * share))
    count.copy_(total)


@torch.no_grad()
def _update_running(module: _BatchNorm, mean: torch.Tensor, m2: torch.Tensor, count: Any) -> None:
    """One update of the running statistics from a set of ``count`` values (their mean and
    sum of squared deviations), as ``nn.BatchNorm`` makes it: ``num_batches_tracked`` + 1,
    then momentum (or the cumulative average when momentum is None) towards the mean and
    the unbiased variance. A module that saw nothing (count 0) keeps its statistics; the
    test is a mask, not a host synchronisation."""
    running_mean, running_var, tracked = module.running_mean, module.running_var, module.num_batches_tracked
    assert running_mean is not None and running_var is not None
    count = torch.as_tensor(count, dtype=torch.float64, device=running_mean.device)
    seen = (count > 0).to(torch.float64)
    if tracked is not None:
        tracked.add_(seen.to(tracked.dtype))
    if module.momentum is None:
        assert tracked is not None
        factor = seen / tracked.clamp(min=1).to(torch.float64)
    else:
        factor = seen * module.momentum
    unbiased = m2.to(torch.float64) / (count - 1).clamp(min=1)
    running_mean.add_(((mean.to(torch.float64) - running_mean) * factor).to(running_mean.dtype))
    running_var.add_(((unbiased - running_var) * factor).to(running_var.dtype))


def convert_batchnorm(
    root: nn.Module,
    scope: Sequence[nn.Module],
    group: Any,
    replica: int,
    replicas: int,
    sync: bool,
    deferred: bool,
) -> int:
    """Replace the BatchNorm modules inside the layers ``scope`` by ``PipelineBatchNorm``
    wherever they are referenced, under ``root`` (a layer that is itself a BatchNorm, a second
    attribute naming one) and inside the layers (a layer traced from ``forward`` holds the
    module's children itself); returns how many were replaced.

    ``sync`` asks for statistics over the stage's replicas (``group``, ``replicas`` > 1; a
    user's ``nn.SyncBatchNorm`` is synchronised over them too, never over the whole job),
    ``deferred`` for running statistics once per step. Nothing to do: no module changes.
    """
    replaced: dict[int, PipelineBatchNorm] = {}
    for layer in scope:
        for module in layer.modules():
            if not isinstance(module, _BatchNorm) or id(module) in replaced:
                continue
            user_sync = isinstance(module, nn.SyncBatchNorm)  # never left to synchronise over the whole job
            synced = (sync or user_sync) and replicas > 1
            if not (synced or user_sync or (deferred and module.track_running_stats)):
                continue
            if type(module).forward is not _BatchNorm.forward and not user_sync:
                raise DappleConfigError(
                    f"{type(module).__name__}",
                    "overrides forward, so its statistics cannot be synchronised across replicas or deferred",
                    "use a plain nn.BatchNorm1d/2d/3d, or turn sync_batchnorm and deferred_batchnorm off",
                )
            replaced[id(module)] = PipelineBatchNorm(module, group if synced else None, replica, replicas, deferred)
    if replaced:
        for parent in [root, *root.modules(), *(module for layer in scope for module in layer.modules())]:
            for name, child in list(parent._modules.items()):
                if child is not None and id(child) in replaced:
                    parent._modules[name] = replaced[id(child)]
    return len(replaced)


class StageBuffers:
    """What happens to a stage's buffers where a training step ends (see the module docstring).

    Built once per plan, after ``convert_batchnorm``: which modules defer their statistics,
    whether their accumulators must be summed over the replicas (deferred without sync:
    each replica saw its own slices) and which buffers the first replica broadcasts (all
    but those of ``PipelineBatchNorm``, identical on every replica by construction). The
    buffer tensors themselves are looked up at each step: moving a module to a device
    replaces them. Under NCCL the compute stream waits for the collectives, not the host.
    """

    def __init__(self, layers: Sequence[nn.Module], group: Any, source: int, replica: int, replicas: int, failure: FailureChannel, stage: int) -> None:
        self.group = group
        self.source = source
        self.replica = replica
        self.replicas = replicas
        self.failure = failure
        self.stage = stage
        modules = list({id(m): m for layer in layers for m in layer.modules()}.values())
        for module in modules:
            if isinstance(module, PipelineBatchNorm) and module.group is not None:
                module.waits = ReplicaWaits(module.group, failure)  # statistics waited as every collective of the stage
        self.waits = ReplicaWaits(group, failure)
        self.deferred = [m for m in modules if isinstance(m, PipelineBatchNorm) and m.deferred]
        self.exchange = group is not None and any(m.group is None for m in self.deferred)
        slots = buffer_slots(layers) if group is not None else []
        self.slots = [(module, name) for module, name in slots if not isinstance(module, PipelineBatchNorm)]

    def _wait(self, works: list[Any], device: torch.device, what: str) -> None:
        self.waits.wait(works, device, what)

    def end_step(self) -> None:
        """Apply the deferred statistics, then make every replica's buffers the first one's."""
        if self.deferred:
            self._apply_deferred()
        if self.slots:
            self._broadcast()

    def _apply_deferred(self) -> None:
        if self.exchange:
            self._sum_over_replicas([m for m in self.deferred if m.group is None])
        for module in self.deferred:
            _update_running(module, module.deferred_mean, module.deferred_m2, module.deferred_count)
            module.reset_accumulators()

    def _sum_over_replicas(self, modules: list[PipelineBatchNorm]) -> None:
        """Every replica's accumulators, merged in replica order into each replica's own
        (one AllReduce of a zero table with one row per replica: the same sums everywhere)."""
        row = torch.cat([torch.cat([m.deferred_count.view(1), m.deferred_mean, m.deferred_m2]) for m in modules])
        table = torch.zeros(self.replicas, row.numel(), dtype=row.dtype, device=row.device)
        table[self.replica] = row
        work = dist.all_reduce(table, group=self.group, async_op=True)
        self._wait([work], table.device, f"BatchNorm statistics of stage {self.stage}")
        offset = 0
        for module in modules:
            channels = module.num_features
            part = table[:, offset : offset + 1 + 2 * channels]
            module.reset_accumulators()
            for index in range(self.replicas):
                merge_statistics(
                    module.deferred_count, module.deferred_mean, module.deferred_m2,
                    part[index, 1 : 1 + channels], part[index, 1 + channels :], part[index, 0],
                )
            offset += 1 + 2 * channels

    def _broadcast(self) -> None:
        """The first replica's buffers to the others, one message per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for module, name in self.slots:
            buffer = module._buffers[name]
            if buffer is not None:
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        flats, works = [], []
        for dtype, buffers in by_dtype.items():
            if self.replica == 0:
                flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
            else:
                flat = torch.empty(sum(buffer.numel() for buffer in buffers), dtype=dtype, device=buffers[0].device)
            flats.append((flat, buffers))
            works.append(dist.broadcast(flat, src=self.source, group=self.group, async_op=True))
        if not flats:
            return
        self._wait(works, flats[0][0].device, f"buffer broadcast of stage {self.stage}")
        if self.replica == 0:
            return
        with torch.no_grad():
            for flat, buffers in flats:
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()
