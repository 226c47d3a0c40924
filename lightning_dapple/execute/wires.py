"""How the transport's messages travel: one wire policy per ``Transport``, chosen once from
(backend, device) -- DAPPLE 5.2.2's split-concat transfers are the same on every wire; what
differs is how a message's bytes get from one rank to the other.

* ``gloo`` (gloo, CPU tensors): ``isend``/``irecv`` of the tensors themselves. gloo accepts a
  message shorter than the receive posted for it, so a known layout's activation travels
  without its flag byte, and receives may be posted ahead (``receives_ahead_pay``).
* ``staged`` (gloo, CUDA tensors: several ranks sharing one GPU, where NCCL refuses to run):
  every message crosses the host through pooled pinned buffers (``staging``). The message
  format is ``gloo``'s, so a CPU rank and a CUDA rank can talk.
* ``nccl`` (NCCL): the messages of one transfer go as one ``batch_isend_irecv`` on a
  communication stream; the compute stream waits on CUDA events, never the host, except
  where an activation's flag byte must be read (a layout change changes what to receive
  next). NCCL needs every receive to match its message's size (so the flag byte travels
  on every activation), has no complex or bool type (such lone tensors go as bytes), and
  runs a pair's operations in issue order on one stream, so receives are never posted
  ahead, and activations and gradients go on two process groups of their own: a send
  blocked until its receiver arrives then holds up only later messages in its own
  direction, as under gloo, where sends never block receives.

``Transport(wire=...)`` forces a policy: ``nccl`` and ``staged`` also run over gloo with CPU
tensors (batched p2p works under gloo; staging then uses plain host memory), so the CPU
tests execute the code NCCL and the staging run.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from lightning_dapple.errors import require
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.staging import Stager

WIRES = ("auto", "gloo", "staged", "nccl")
DIRECTIONS = ("activation", "gradient")


class Incoming(NamedTuple):
    """A posted receive: where its message lands and what waiting for it needs."""

    peer: int
    work: Any  # a Work, a list of them (a batch), or None (a CUDA stream waits instead)
    buffer: torch.Tensor  # the message's bytes: on the device, or a host buffer (staged)
    shape: tuple[int, ...]
    dtype: torch.dtype
    flagged: bool  # an activation receive: its last byte is the layout flag
    extra: Any = None  # staged: the pool key; nccl on CUDA: (event, pinned flag byte)


def backend_for(device: torch.device) -> str | None:
    """The process group's backend for tensors on ``device`` (None: no process group)."""
    if not dist.is_initialized():
        return None
    backend = str(dist.get_backend())
    if ":" not in backend:
        return backend
    # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
    by_device = dict(part.split(":", 1) for part in backend.split(","))
    return by_device.get(device.type, next(iter(by_device.values())))


def choose_wire(wire: str, device: torch.device) -> str:
    """The wire policy for ``wire`` (``auto`` or a forced one) on this backend and device;
    a forced one that cannot work here is refused with what to do instead."""
    require(wire in WIRES, "wire", f"is {wire!r}", f"use one of {', '.join(WIRES)}")
    backend = backend_for(device)
    gloo = backend in (None, "gloo")
    if wire == "auto":
        require(
            not (backend == "nccl" and device.type != "cuda"),
            "device",
            f"the process group uses NCCL, which cannot send {device.type} tensors",
            "put the stages on GPUs, or use the gloo backend for CPU training",
        )
        if not gloo:
            return "nccl"
        return "gloo" if device.type == "cpu" else "staged"
    if wire in ("gloo", "staged"):
        require(gloo, "wire", f"{wire!r} needs the gloo backend, the process group uses {backend}", "use wire='auto'")
        require(
            wire == "staged" or device.type == "cpu",
            "wire",
            f"'gloo' cannot send {device.type} tensors (gloo reads host memory only)",
            "use wire='staged' (or 'auto') for GPU tensors over gloo",
        )
    else:
        require(
            (backend == "nccl" and device.type == "cuda") or (gloo and device.type == "cpu"),
            "wire",
            f"'nccl' needs the NCCL backend with CUDA tensors (or gloo with CPU tensors, for tests); "
            f"this run has {backend} with {device.type} tensors",
            "use wire='auto'",
        )
    return wire


class Wire:
    """The gloo policy, and the interface of the others."""

    name = "gloo"
    short_messages = True  # a known layout's activation may omit its flag byte
    posts_ahead = True  # receives may be posted before the action that needs them
    batched = False  # a transfer's sends are issued together (``send``), not one by one
    zero_flags = True  # activation receive buffers start zeroed (short messages leave the flag)
    pooled = False  # sent buffers go back to a pool (``release``) once their sends are waited

    def __init__(self, device: torch.device, failure: FailureChannel) -> None:
        self.device = device
        self.failure = failure

    @staticmethod
    def typed(dtype: torch.dtype) -> bool:
        """Whether a lone tensor of ``dtype`` travels in its own dtype (else as bytes)."""
        return not dtype.is_complex

    def send_one(self, tensor: torch.Tensor, peer: int) -> tuple[Any, Any]:
        """Issue one message: its work and what must stay alive until that work is waited."""
        tensor = tensor if tensor.device == self.device else tensor.to(self.device)
        return dist.isend(tensor, peer), tensor

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str) -> list[tuple[Any, Any]]:
        return [self.send_one(tensor, peer) for tensor, peer in messages]

    def release(self, kept: Sequence[Any]) -> None:
        """Sends whose works were waited: their buffers are free again."""

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False) -> list[Incoming]:
        """Receives of ``(peer, BufferSpec, flagged)``; ``control`` messages (headers,
        structures) are read on the host."""
        out = []
        for peer, spec, flagged in specs:
            buffer = spec.make(self.device, self.zero_flags)
            out.append(Incoming(peer, dist.irecv(buffer, peer), buffer, spec.shape, spec.dtype, flagged))
        return out

    def wait(self, incoming: Sequence[Incoming], what: str) -> list[tuple[torch.Tensor, int]]:
        """The received tensors, ready for the compute stream, and each flag byte (0 where
        the receive has none)."""
        self.failure.wait_all([item.work for item in incoming], what)
        return _with_flags(incoming)


def _with_flags(incoming: Sequence[Incoming]) -> list[tuple[torch.Tensor, int]]:
    """Received host buffers and their flag bytes (their last, where they have one)."""
    return [(item.buffer, int(item.buffer[-1]) if item.flagged and item.buffer.numel() else 0) for item in incoming]


class StagedWire(Wire):
    """gloo with CUDA tensors: every message through pooled pinned host buffers."""

    name = "staged"
    batched = True
    pooled = True

    def __init__(self, device: torch.device, failure: FailureChannel) -> None:
        super().__init__(device, failure)
        self.stager = Stager(device)

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str) -> list[tuple[Any, Any]]:
        # on a CUDA rank, control messages (built on the host) go as they are; on a CPU
        # "device" (the tests) every message goes through the staging code
        stage = [t.device.type != "cpu" or self.device.type == "cpu" for t, _ in messages]
        keys = [("send", peer, t.numel() * t.element_size()) for t, peer in messages]
        hosts = iter(self.stager.to_host([(t, key) for (t, _), key, s in zip(messages, keys, stage) if s]))
        out: list[tuple[Any, Any]] = []
        for (tensor, peer), key, staged in zip(messages, keys, stage):
            if staged:
                host = next(hosts)
                out.append((dist.isend(host, peer), (key, host)))
            else:
                out.append((dist.isend(tensor, peer), None))
        return out

    def release(self, kept: Sequence[Any]) -> None:
        for item in kept:
            if item is not None:
                self.stager.pool.give(*item)

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False) -> list[Incoming]:
        out = []
        for peer, spec, flagged in specs:
            if control:  # read on the host: no device round trip
                buffer = spec.make(torch.device("cpu"))
                out.append(Incoming(peer, dist.irecv(buffer, peer), buffer, spec.shape, spec.dtype, False))
                continue
            key = ("recv", peer, spec.nbytes(), flagged)
            host = self.stager.pool.take(key, spec.nbytes(), zeroed=flagged)
            out.append(Incoming(peer, dist.irecv(host, peer), host, spec.shape, spec.dtype, flagged, key))
        return out

    def wait(self, incoming: Sequence[Incoming], what: str) -> list[tuple[torch.Tensor, int]]:
        self.failure.wait_all([item.work for item in incoming], what)
        out = []
        for item in incoming:
            if item.extra is None:
                out.append((item.buffer, 0))
                continue
            flag = int(item.buffer[-1]) if item.flagged and item.buffer.numel() else 0  # read on the host
            out.append((self.stager.to_device(item.buffer, item.shape, item.dtype, item.extra), flag))
        return out


class NcclWire(Wire):
    """Batched p2p on a communication stream per direction; see the module docstring."""

    name = "nccl"
    short_messages = False
    posts_ahead = False
    batched = True
    zero_flags = False

    def __init__(self, device: torch.device, failure: FailureChannel) -> None:
        super().__init__(device, failure)
        self.cuda = device.type == "cuda"
        # every rank builds its Transport at the same point (new_group is collective)
        self.groups = {direction: dist.new_group() for direction in DIRECTIONS}
        self.streams: dict[str, Any] = {}
        self._flag_bytes: dict[int, torch.Tensor] = {}
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            for direction, group in self.groups.items():
                # batch_isend_irecv's first call in a group must involve all its ranks: a
                # barrier creates the communicator now, on every rank
                dist.barrier(group=group, device_ids=[index])
                self.streams[direction] = torch.cuda.Stream(device)

    @staticmethod
    def typed(dtype: torch.dtype) -> bool:
        return not dtype.is_complex and dtype is not torch.bool

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str) -> list[tuple[Any, Any]]:
        if not messages:  # batch_isend_irecv refuses an empty batch
            return []
        tensors = [t if t.device == self.device else t.to(self.device) for t, _ in messages]
        group = self.groups[direction]
        ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, (_, peer) in zip(tensors, messages)]
        if not self.cuda:
            return _per_message(dist.batch_isend_irecv(ops), tensors)
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the data is produced there
        with torch.cuda.stream(stream):
            for work in dist.batch_isend_irecv(ops):
                work.wait()  # the communication stream waits, not the host
        for tensor in tensors:
            tensor.record_stream(stream)  # freed by the compute stream: reused only after the send
        return [(None, t) for t in tensors]

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False) -> list[Incoming]:
        if not specs:
            return []
        group = self.groups[direction]
        if not self.cuda:
            buffers = [spec.make(self.device, self.zero_flags) for _, spec, _ in specs]
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, group=group) for b, (peer, _, _) in zip(buffers, specs)])
            return [
                Incoming(peer, work, b, spec.shape, spec.dtype, flagged)
                for (work, b), (peer, spec, flagged) in zip(_per_message(works, buffers), specs)
            ]
        stream = self.streams[direction]
        with torch.cuda.stream(stream):
            # allocated on the communication stream: the receive need not wait for kernels
            # queued on the compute stream (record_stream in ``wait`` hands them over)
            buffers = [spec.make(self.device, self.zero_flags) for _, spec, _ in specs]
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, group=group) for b, (peer, _, _) in zip(buffers, specs)])
            for work in works:
                work.wait()
            flags = [self._copy_flag(peer, b) if flagged else None for b, (peer, _, flagged) in zip(buffers, specs)]
            done = torch.cuda.Event()
            done.record(stream)
        return [
            Incoming(peer, works, b, spec.shape, spec.dtype, flagged, (done, flag))
            for b, flag, (peer, spec, flagged) in zip(buffers, flags, specs)
        ]

    def _copy_flag(self, peer: int, buffer: torch.Tensor) -> torch.Tensor:
        """Copy a received activation's flag byte into a pinned host byte (on the current,
        communication stream), so reading it waits for the transfer, not the compute stream."""
        flag = self._flag_bytes.get(peer)
        if flag is None:
            flag = self._flag_bytes[peer] = torch.zeros(1, dtype=torch.uint8, pin_memory=True)
        flag.copy_(buffer[-1:], non_blocking=True)
        return flag

    def wait(self, incoming: Sequence[Incoming], what: str) -> list[tuple[torch.Tensor, int]]:
        if not self.cuda:
            self.failure.wait_all(flat_works(item.work for item in incoming), what)
            return _with_flags(incoming)
        compute = torch.cuda.current_stream(self.device)
        events = {id(item.extra[0]): item.extra[0] for item in incoming}
        for event in events.values():
            compute.wait_event(event)
        for item in incoming:
            item.buffer.record_stream(compute)
        if not any(item.flagged for item in incoming):
            return [(item.buffer, 0) for item in incoming]
        # the flag decides what to receive next: the host waits, bounded, for the transfer
        self.failure.wait_all(flat_works(item.work for item in incoming), what)
        for event in events.values():
            event.synchronize()
        return [(item.buffer, int(item.extra[1][0]) if item.flagged else 0) for item in incoming]


def _per_message(works: list[Any], kept: list[Any]) -> list[tuple[Any, Any]]:
    """Pair a batch's works with its messages: one each where the backend does not coalesce
    the batch (gloo); else the whole list goes with the first message (see ``flat_works``)."""
    if len(works) == len(kept):
        return list(zip(works, kept))
    return [(works if index == 0 else None, item) for index, item in enumerate(kept)]


def flat_works(works: Any) -> list[Any]:
    """Works to wait for, from a Work, a list of them, or None, without repeats."""
    out: list[Any] = []
    for work in works:
        for item in work if isinstance(work, list) else (work,):
            if item is not None and all(item is not seen for seen in out):
                out.append(item)
    return out


def make_wire(wire: str, device: torch.device, failure: FailureChannel) -> Wire:
    """The wire for ``wire`` (``auto`` or forced; see ``choose_wire``)."""
    name = choose_wire(wire, device)
    if name == "staged":
        return StagedWire(device, failure)
    if name == "nccl":
        return NcclWire(device, failure)
    return Wire(device, failure)


