"""Bucketed gradient AllReduce of a replicated stage, overlapped with its backward.

DAPPLE 5.2.3: the replicas of a stage sum their accumulated gradients once per step. As
in every data-parallel runtime (torch DDP's buckets, ooo-backprop's reverse first-k,
sec. 5.1), the sum of the last layers' gradients need not wait for the first layers'
backward: the stage's parameters are grouped into buckets of about ``BUCKET_BYTES``
(``plan/buckets.py``, the size the planner's latency model charges), and a bucket's
AllReduce starts as soon as all its parameters hold their final gradient of the step,
while the stage computes on. The step waits for the buckets at its end.

When a parameter's gradient is final is known from the action list, once per plan:

* a layer whose weights get their gradient from an ordinary backward is final during the
  stage's last B: a post-accumulate-grad hook, live only during that B, reports each
  parameter as autograd finishes it (DDP's mechanism);
* a layer whose weight gradients are deferred to W (``execute/weight_grad.py``) is final
  after the last W that does work for it.

Buckets are ``plan.buckets.bucket_layers`` ranges (from the last layers back, as DDP fills
them) and are launched strictly in that order, so every replica issues the same
collectives in the same order whatever the timing. Under out-of-order backprop the ending
phase's reverse first-k order finishes the first layers early, but their bucket still
launches last: the order stays the planner's.

Under ZeRO-2 (``strategy/zero.py``) each replica keeps only the gradients of the parameters
whose optimizer state it holds, so a bucket is reduced to the owners instead of summed
everywhere (``OwnerBucket``): one ``dist.reduce`` per owner with a part in the bucket, of
that owner's parameters packed together, launched from the same hooks in the same order.
Reductions rather than one reduce-scatter of the bucket, because the shares are whole
parameters: a bucket's parts per owner have unequal sizes (a bucket may be one parameter
of one owner), and a reduce-scatter takes equal chunks, so it would send zeros padding
every part to the largest; per-owner reductions send each element once, as a
reduce-scatter would, and cost one collective latency per owner and bucket instead of one
per bucket (a few owners, buckets of ``BUCKET_BYTES``). Both gloo and NCCL have them.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.transfer.wires import waits_on_device

__all__ = ["FlatBucket", "GradientSync", "OwnerBucket"]


class FlatBucket:
    """Parameters whose gradients are summed by one flat AllReduce: packed into one buffer
    (made on the first step, reused after: dtypes and devices do not change), reduced
    asynchronously, and unpacked into ``.grad``. Shared by the replica buckets here and the
    tied-parameter sums (``execute/tied.py``); under NCCL the compute stream, not the host,
    waits for the sum (``failure.wait_on_device``), under gloo the host does."""

    __slots__ = ("params", "flat", "work", "missing", "on_device", "device_index")

    def __init__(self, params: list[nn.Parameter], group: Any) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None
        self.work: Any = None
        self.missing = len(params)
        device = params[0].device if params else torch.device("cpu")
        self.on_device, self.device_index = waits_on_device(device, group), device.index

    def reset(self) -> None:
        """Forget a reduction left by a step that failed."""
        self.work = None

    def launch(self, group: Any) -> None:
        """Pack the gradients (zeros where a parameter got none; a sparse one, of an
        ``nn.Embedding(sparse=True)``, densified) and start their sum."""
        grads = [(p.grad.to_dense() if p.grad.is_sparse else p.grad) if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if self.flat is None:
            dtype = grads[0].dtype
            for grad in grads[1:]:
                dtype = torch.promote_types(dtype, grad.dtype)
            self.flat = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=self.flat)
        self.work = dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def finish(self, failure: FailureChannel, what: str) -> None:
        """Wait for the sum (bounded by ``failure``) and put it into ``.grad``."""
        if self.on_device:
            failure.wait_on_device([self.work], what, self.device_index)
        else:
            failure.wait(self.work, what)
        assert self.flat is not None
        offset = 0
        for param in self.params:
            count = param.numel()
            summed = self.flat[offset : offset + count].view_as(param)
            if param.grad is None:
                param.grad = summed.clone()
            elif param.grad.is_sparse:  # stays sparse for the optimizer (SparseAdam takes nothing else)
                param.grad = summed.to_sparse(param.grad.sparse_dim())
            else:
                param.grad.copy_(summed)
            offset += count
        self.work = None


class OwnerBucket:
    """A replica bucket reduced to the owners of its parameters (ZeRO-2, module docstring).

    ``owners``: id(parameter) -> the global rank of the replica that keeps its gradient;
    a parameter without one (in no optimizer's share) is summed on every replica, as a
    ``FlatBucket`` sums it. Each owner's part is packed into a buffer of its own when the
    bucket launches, and the bucket's ``.grad`` are dropped then: the packed copy replaces
    them, so from the launch on the bucket's gradients take its buffers' bytes only. After
    the reductions the owner's gradients are views of its part's buffer (which holds nothing
    but them) and the other parts' buffers are freed: a replica keeps its share.
    """

    __slots__ = ("params", "parts", "rank", "flats", "works", "sparse", "missing", "on_device", "device_index")

    def __init__(self, params: list[nn.Parameter], owners: Mapping[int, int], rank: int, group: Any) -> None:
        self.params = params
        by_owner: dict[int, list[nn.Parameter]] = {}
        for param in params:
            by_owner.setdefault(owners.get(id(param), -1), []).append(param)
        # the same order on every replica: the parameters summed everywhere (-1), then by owner
        self.parts = sorted(by_owner.items(), key=lambda part: part[0])
        self.rank = rank
        self.flats: list[torch.Tensor] = []
        self.works: list[Any] = []
        self.sparse: dict[int, int] = {}  # id(parameter) -> sparse_dim of a sparse gradient
        self.missing = len(params)
        device = params[0].device if params else torch.device("cpu")
        self.on_device, self.device_index = waits_on_device(device, group), device.index

    def reset(self) -> None:
        """Forget reductions left by a step that failed."""
        self.flats, self.works = [], []

    def launch(self, group: Any) -> None:
        """Pack each owner's gradients (zeros where a parameter got none, a sparse one
        densified), drop the ``.grad`` packed, and start each part's reduction."""
        self.flats, self.works, self.sparse = [], [], {}
        for owner, params in self.parts:
            grads = []
            for param in params:
                grad = param.grad
                if grad is None:
                    grad = torch.zeros_like(param)
                elif grad.is_sparse:
                    self.sparse[id(param)] = grad.sparse_dim()
                    grad = grad.to_dense()
                grads.append(grad.reshape(-1))
                param.grad = None
            flat = torch.cat(grads)  # promotes mixed dtypes, as FlatBucket does
            del grads
            if owner < 0:
                work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
            else:
                work = dist.reduce(flat, dst=owner, op=dist.ReduceOp.SUM, group=group, async_op=True)
            self.flats.append(flat)
            self.works.append(work)

    def finish(self, failure: FailureChannel, what: str) -> None:
        """Wait for the reductions (bounded by ``failure``); the parts this rank keeps become
        its ``.grad``, the others are freed."""
        if self.on_device:
            failure.wait_on_device(self.works, what, self.device_index)
        else:
            for work in self.works:
                failure.wait(work, what)
        for (owner, params), flat in zip(self.parts, self.flats):
            if owner >= 0 and owner != self.rank:
                continue
            offset = 0
            for param in params:
                grad = flat[offset : offset + param.numel()].view_as(param)
                offset += param.numel()
                if grad.dtype != param.dtype:
                    grad = grad.to(param.dtype)
                if id(param) in self.sparse:  # stays sparse for the optimizer (SparseAdam takes nothing else)
                    grad = grad.to_sparse(self.sparse[id(param)])
                param.grad = grad
        self.flats, self.works = [], []


class GradientSync:
    """The overlapped AllReduce of one replicated stage, or under ZeRO-2 its reductions to
    the owners (see the module docstring).

    ``buckets`` lists the stage's parameters in launch order; ``hooked`` are those whose
    readiness autograd reports (the others are reported by the runner after their W).
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[nn.Parameter]],
        hooked: Sequence[nn.Parameter],
        group: Any,
        failure: FailureChannel,
        stage: int,
    ) -> None:
        self.group = group
        self.failure = failure
        self.stage = stage
        self._buckets: list[FlatBucket | OwnerBucket] = [FlatBucket(list(params), group) for params in buckets if params]
        self._bucket_of = {id(p): index for index, bucket in enumerate(self._buckets) for p in bucket.params}
        self.owners: Mapping[int, int] | None = None  # ZeRO-2: id(parameter) -> the rank keeping its gradient
        self._ready: set[int] = set()
        self._next = 0
        self.launched_early = 0  # buckets of the last step started before its end (overlapped)
        self.live = False  # hooks report only during the stage's last ordinary backward
        self._handles = [param.register_post_accumulate_grad_hook(self._hook) for param in hooked]

    def close(self) -> None:
        """Take this sync's hooks off the parameters (a new one replaces it)."""
        self.live = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, param: torch.Tensor) -> None:
        if self.live:
            self.ready(param)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def reduce_to_owners(self, owners: Mapping[int, int], rank: int) -> None:
        """ZeRO-2 (module docstring): from the next step on, each bucket's gradients are
        reduced to the replica owning each parameter (``owners``: id(parameter) -> global
        rank; ``rank``: this one), in the same buckets and the same order."""
        self.owners = owners
        self._buckets = [OwnerBucket(bucket.params, owners, rank, self.group) for bucket in self._buckets]

    def start_step(self) -> None:
        self._ready.clear()
        self._next = 0
        self.launched_early = 0
        for bucket in self._buckets:
            bucket.missing = len(bucket.params)
            bucket.reset()

    def ready(self, param: torch.Tensor) -> None:
        """``param`` holds its final gradient of the step: launch what is complete."""
        key = id(param)
        if key in self._ready:
            return
        self._ready.add(key)
        index = self._bucket_of.get(key)
        if index is None:
            return
        self._buckets[index].missing -= 1
        while self._next < len(self._buckets) and self._buckets[self._next].missing == 0:
            self._launch(self._buckets[self._next])
            self._next += 1
            self.launched_early += 1

    def ready_all(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            self.ready(param)

    def _launch(self, bucket: FlatBucket | OwnerBucket) -> None:
        bucket.launch(self.group)

    def finish(self) -> None:
        """Launch what is left (parameters that got no gradient this step), wait for every
        bucket and put the sums back into ``.grad`` (under ZeRO-2 the owned ones only)."""
        self.live = False
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        what = f"gradient {'reduction to the owners' if self.owners is not None else 'AllReduce'} of stage {self.stage}"
        for bucket in self._buckets:
            bucket.finish(self.failure, what)
