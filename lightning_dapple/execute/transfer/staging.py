"""Host buffers through which CUDA tensors travel over gloo (several ranks on one GPU).

gloo only moves host memory (a CUDA tensor handed to it fails with "writev: Bad address"),
and NCCL refuses two ranks on one GPU, so on a one-GPU machine every pipeline boundary
(DAPPLE 5.2.2: the split-concat transfers between stages) crosses the host: device -> host
before the send, host -> device after the receive. Those copies go through page-locked
(pinned) buffers, which the GPU copies into and out of asynchronously and faster than into
pageable memory; allocating pinned memory is expensive (it locks pages), so buffers are
kept per (direction, peer, size) and reused: the executor's messages have a handful of
sizes per boundary, so the pool is built in the first step and only reused afterwards.

Without CUDA (the tests' forced ``staged`` wire on CPU) the same code runs with plain host
memory and synchronous copies.
"""
from __future__ import annotations

from typing import Any

import torch


class HostPool:
    """Reusable host byte buffers, by key; a buffer is lent until it is given back.

    A buffer given back with an event (a copy out of it still running on a stream) is lent
    again only after that event: ``take`` waits for it, which in practice has long passed.
    Buffers of a ``zeroed`` key keep their last byte zero while idle (an activation's flag
    byte, which a short message leaves as it was; see ``transport``).
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._idle: dict[tuple[Any, ...], list[tuple[torch.Tensor, Any]]] = {}
        self.allocated = 0  # buffers made so far (reuse keeps this flat after the first step)

    def take(self, key: tuple[Any, ...], nbytes: int, zeroed: bool = False) -> torch.Tensor:
        idle = self._idle.get(key)
        if idle:
            buffer, event = idle.pop()
            if event is not None:
                event.synchronize()
            if zeroed and nbytes and int(buffer[-1]):
                buffer[-1] = 0
            return buffer
        self.allocated += 1
        make = torch.zeros if zeroed else torch.empty
        return make(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, key: tuple[Any, ...], buffer: torch.Tensor, event: Any = None) -> None:
        self._idle.setdefault(key, []).append((buffer, event))

    def clear(self) -> None:
        self._idle.clear()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class Stager:
    """Device <-> host copies on a side stream, so the compute stream never waits on the host.

    ``to_host`` copies device tensors into pooled host buffers and returns once the copies
    are done (gloo reads the buffers from its own thread right after). ``to_device`` copies
    a received host buffer into a new device tensor without blocking the host: the compute
    stream waits on an event recorded after the copy, and the host buffer returns to the
    pool with that event.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = HostPool(pin=self.cuda and torch.cuda.is_available())
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def to_host(self, tensors: list[tuple[torch.Tensor, tuple[Any, ...]]]) -> list[torch.Tensor]:
        """Host copies of ``(tensor, pool key)`` pairs, each in a buffer from the pool."""
        if self.stream is None:
            return [self._copy_into(self.pool.take(key, t.numel() * t.element_size()), t) for t, key in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensors are produced there
        with torch.cuda.stream(self.stream):
            hosts = [self._copy_into(self.pool.take(key, t.numel() * t.element_size()), t, True) for t, key in tensors]
        self.stream.synchronize()  # gloo reads them from its own thread as soon as the send is issued
        return hosts

    @staticmethod
    def _copy_into(host: torch.Tensor, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if host.numel():
            host.copy_(byte_view(tensor), non_blocking=non_blocking)
        return host

    def to_device(self, host: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, key: tuple[Any, ...]) -> torch.Tensor:
        """A device tensor of ``shape``/``dtype`` holding ``host``'s bytes; ``host`` goes back
        to the pool under ``key`` once the copy is done."""
        if self.stream is None:
            out = torch.empty(shape, dtype=dtype, device=self.device)
            if host.numel():
                byte_view(out).copy_(host)
            self.pool.give(key, host)
            return out
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            # allocated on the side stream, so the copy need not wait for kernels queued on
            # the compute stream; record_stream below keeps it alive for the compute stream
            out = torch.empty(shape, dtype=dtype, device=self.device)
            if host.numel():
                byte_view(out).copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)
        out.record_stream(compute)
        self.pool.give(key, host, done)
        return out
