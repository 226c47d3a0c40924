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
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.wires import waits_on_device

__all__ = ["GradientSync"]


class _Bucket:
    __slots__ = ("params", "flat", "work", "missing")

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.flat: torch.Tensor | None = None
        self.work: Any = None
        self.missing = len(params)


class GradientSync:
    """The overlapped AllReduce of one replicated stage (see the module docstring).

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
        self._buckets = [_Bucket(list(params)) for params in buckets if params]
        self._bucket_of = {id(p): index for index, bucket in enumerate(self._buckets) for p in bucket.params}
        self._ready: set[int] = set()
        self._next = 0
        self.launched_early = 0  # buckets of the last step started before its end (overlapped)
        self.live = False  # hooks report only during the stage's last ordinary backward
        # under NCCL the compute stream waits for each bucket, not the host (failure.wait_on_device)
        device = next((p.device for params in buckets for p in params), torch.device("cpu"))
        self._on_device, self._device_index = waits_on_device(device, group), device.index
        for param in hooked:
            param.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: torch.Tensor) -> None:
        if self.live:
            self.ready(param)

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def start_step(self) -> None:
        self._ready.clear()
        self._next = 0
        self.launched_early = 0
        for bucket in self._buckets:
            bucket.missing = len(bucket.params)
            bucket.work = None

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

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if bucket.flat is None:  # built on the first step, reused after (dtypes and devices do not change)
            dtype = grads[0].dtype
            for grad in grads[1:]:
                dtype = torch.promote_types(dtype, grad.dtype)
            bucket.flat = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what is left (parameters that got no gradient this step), wait for every
        bucket and put the sums back into ``.grad``."""
        self.live = False
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        what = f"gradient AllReduce of stage {self.stage}"
        for bucket in self._buckets:
            if self._on_device:
                self.failure.wait_on_device([bucket.work], what, self._device_index)
            else:
                self.failure.wait(bucket.work, what)
            assert bucket.flat is not None
            offset = 0
            for param in bucket.params:
                count = param.numel()
                summed = bucket.flat[offset : offset + count].view_as(param)
                if param.grad is None:
                    param.grad = summed.clone()
                else:
                    param.grad.copy_(summed)
                offset += count
            bucket.work = None
