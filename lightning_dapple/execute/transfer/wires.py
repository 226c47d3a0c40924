"""How the transport's messages travel: one wire policy per ``Transport``, chosen once from
(backend, device) -- DAPPLE 5.2.2's split-concat transfers are the same on every wire; what
differs is how a message's bytes get from one rank to the other.

* ``gloo`` (gloo, CPU tensors): ``isend``/``irecv`` of the tensors themselves. gloo accepts a
  message shorter than the receive posted for it, so a known layout's activation travels
  without its flag byte, and receives may be posted ahead (``receives_ahead_pay``).
* ``staged`` (gloo, CUDA tensors: several ranks sharing one GPU, where NCCL refuses to run):
  every message crosses the host through pooled pinned buffers (``staging``). The message
  format is ``gloo``'s, so a CPU rank and a CUDA rank can talk.
* ``nccl`` (NCCL): every message is its own ``isend``/``irecv`` on a communicator of its
  own. NCCL runs one communicator's operations in issue order on one stream, so a receive
  issued after a send on the same communicator starts only when that send's receiver has
  taken it: with one communicator per direction, a middle stage could not receive F(k+1)'s
  input before the next stage had posted its receive of k (``torch.distributed.pipelining``
  stopped coalescing sends with receives for the same head-of-line blocking). Here every
  link (a pair of adjacent-stage ranks, ``links.plan_links``) gets one two-rank process
  group per direction: a communicator carries one sender's messages to one receiver, in the
  order both action lists issue them (``links.link_orders``; the tests check every
  schedule), and nothing else waits behind them. A rank holding several stages (chunks)
  sends one peer several boundaries, which the merged orders interleave differently at the
  two ends; there each boundary and direction (a stream, ``links.plan_streams``) gets its
  own group, the communicator standing in for gloo's tag, and each stream goes in one
  order at both ends (``links.check_stream_orders``). A group per link, not one group with
  unbatched point-to-point calls: once the default group is bound to a device
  (``init_process_group(device_id=...)``, which Lightning does), ProcessGroupNCCL sends a
  group's unbatched point-to-point operations through the group's own communicator. The
  groups are made (collectively) and each is used once, in one global order, when the wire
  is built, since NCCL connects a pair on its first operation and blocks the host until the
  peer arrives. Waits are on the GPU (see ``failure``): the compute stream waits for a
  receive, the host does not, except for the bytes it must read (an activation's flag
  byte, a header), copied to pinned memory behind that receive alone (``HostReader``);
  receives are issued from a stream with nothing queued, so they never wait for queued
  compute. Sends are not waited: ProcessGroupNCCL records each sent tensor on its own
  stream, so the memory outlives the send. NCCL needs every receive to match its
  message's size (the flag byte travels on every activation), has no complex or bool type
  (such lone tensors go as bytes), and receives are posted when due, not ahead. Torch
  below 2.5 may split a two-rank group's first point-to-point communicator from the
  default one, which every rank must join: the set-up would hang, so there the wire is
  refused (``check_nccl_links_torch``).

``Transport(wire=...)`` forces a policy: ``nccl`` and ``staged`` also run over gloo with CPU
tensors (the ``nccl`` wire's link groups and message order are the same there, its waits
gloo's; staging then uses plain host memory), so the CPU tests execute the code NCCL and
the staging run.
"""
from __future__ import annotations

from itertools import combinations
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from lightning_dapple.errors import require
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.transfer.keys import Direction, stream_tag
from lightning_dapple.execute.process_groups import subgroup
from lightning_dapple.execute.transfer.staging import Stager

WIRES = ("auto", "gloo", "staged", "nccl")
DIRECTIONS = ("activation", "gradient")


class Incoming(NamedTuple):
    """A posted receive: where its message lands and what waiting for it needs."""

    peer: int
    work: Any  # the receive's Work
    buffer: torch.Tensor  # the message's bytes: on the device, or a host buffer (staged)
    shape: tuple[int, ...]
    dtype: torch.dtype
    flagged: bool  # an activation receive: its last byte is the layout flag
    extra: Any = None  # staged: the pool key
    control: bool = False  # a header or structure: read on the host


#: the dtypes NCCL reduces and sends as themselves (ncclDataType_t); int16 and bool are not among them
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64})


def backend_for(device: torch.device, group: Any = None) -> str | None:
    """The backend of ``group`` (default: the default group) for tensors on ``device``
    (None: no process group)."""
    if not dist.is_initialized():
        return None
    backend = str(dist.get_backend(group))
    if ":" not in backend:
        return backend
    # one backend per device type, e.g. "cpu:gloo,cuda:nccl"
    by_device = dict(part.split(":", 1) for part in backend.split(","))
    return by_device.get(device.type, next(iter(by_device.values())))


def waits_on_device(device: torch.device, group: Any = None) -> bool:
    """Whether waits for ``group``'s communication on ``device`` happen on the GPU (NCCL)
    rather than on the host (gloo, also with CUDA tensors): see ``failure``."""
    return device.type == "cuda" and backend_for(device, group) == "nccl"


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
            check_nccl_links_torch()
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
    if wire == "nccl" and not gloo:
        check_nccl_links_torch()
    return wire


#: the first torch whose unbatched point-to-point on a two-rank group does not wait for every rank
NCCL_LINKS_TORCH = (2, 5)


def check_nccl_links_torch() -> None:
    """Refuse the ``nccl`` wire under real NCCL on torch below 2.5. There, the first
    unbatched send on one of the wire's two-rank groups may create its communicator by
    ``ncclCommSplit`` from the default one, a collective of every rank of the job, while
    the link set-up reaches each pair's first message in turn (``link_groups``): the ranks
    outside the pair never join, and the set-up hangs (fixed by pytorch PR 132900, in 2.5)."""
    version = TorchVersion(torch.__version__)
    require(
        version >= NCCL_LINKS_TORCH,
        "wire",
        f"'nccl' (a two-rank NCCL communicator per link) on torch {version} would hang at the links' set-up "
        "(a pair's first send may split from the default communicator and wait for every rank)",
        "upgrade torch to 2.5 or later (pip install 'torch>=2.5'), or keep this torch and run the pipeline "
        "over gloo (DappleStrategy(process_group_backend='gloo'): the staged wire)",
    )


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

    def send_one(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> tuple[Any, Any]:
        """Issue one message: its work and what must stay alive until that work is waited.
        ``tag`` keeps apart message streams between the same two ranks (gloo matches a
        receive with the oldest message of its peer and tag)."""
        tensor = tensor if tensor.device == self.device else tensor.to(self.device)
        return dist.isend(tensor, peer, tag=tag), tensor

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str, tag: int = 0) -> list[tuple[Any, Any]]:
        return [self.send_one(tensor, peer, tag) for tensor, peer in messages]

    def release(self, kept: Sequence[Any]) -> None:
        """Sends whose works were waited: their buffers are free again."""

    def wait_sends(self, works: Sequence[Any], what: str) -> None:
        """Wait until sends are done with their buffers (the host waits, bounded)."""
        self.failure.wait_all(works, what)

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False, tag: int = 0) -> list[Incoming]:
        """Receives of ``(peer, BufferSpec, flagged)``; ``control`` messages (headers,
        structures) are read on the host; ``tag`` as in ``send_one``."""
        out = []
        for peer, spec, flagged in specs:
            buffer = spec.make(self.device, self.zero_flags)
            out.append(Incoming(peer, dist.irecv(buffer, peer, tag=tag), buffer, spec.shape, spec.dtype, flagged))
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

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str, tag: int = 0) -> list[tuple[Any, Any]]:
        # on a CUDA rank, control messages (built on the host) go as they are; on a CPU
        # "device" (the tests) every message goes through the staging code
        stage = [t.device.type != "cpu" or self.device.type == "cpu" for t, _ in messages]
        keys = [("send", peer, t.numel() * t.element_size()) for t, peer in messages]
        hosts = iter(self.stager.to_host([(t, key) for (t, _), key, s in zip(messages, keys, stage) if s]))
        out: list[tuple[Any, Any]] = []
        for (tensor, peer), key, staged in zip(messages, keys, stage):
            if staged:
                host = next(hosts)
                out.append((dist.isend(host, peer, tag=tag), (key, host)))
            else:
                out.append((dist.isend(tensor, peer, tag=tag), None))
        return out

    def release(self, kept: Sequence[Any]) -> None:
        for item in kept:
            if item is not None:
                self.stager.pool.give(*item)

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False, tag: int = 0) -> list[Incoming]:
        out = []
        for peer, spec, flagged in specs:
            if control:  # read on the host: no device round trip
                buffer = spec.make(torch.device("cpu"))
                out.append(Incoming(peer, dist.irecv(buffer, peer, tag=tag), buffer, spec.shape, spec.dtype, False))
                continue
            key = ("recv", peer, spec.nbytes(), flagged)
            host = self.stager.pool.take(key, spec.nbytes(), zeroed=flagged)
            out.append(Incoming(peer, dist.irecv(host, peer, tag=tag), host, spec.shape, spec.dtype, flagged, key))
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


class HostReader:
    """Receives whose values the host must read, without waiting for queued compute.

    Receives are issued from this reader's stream, which has nothing queued whenever one is
    issued (the host blocks on everything it queues there), so under NCCL they start at once
    and never wait for the compute stream. ``read`` queues, on the same stream, waits for
    some receives and copies of their bytes to pinned host memory, and blocks the host on an
    event behind those copies alone (bounded by the failure channel's watchdog).
    """

    def __init__(self, device: torch.device, failure: FailureChannel) -> None:
        self.failure = failure
        self.stream = torch.cuda.Stream(device)
        self._scratch: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # see ``read``

    def issuing(self) -> Any:
        """The context in which to allocate receive buffers and issue receives."""
        return torch.cuda.stream(self.stream)

    def read(self, works: Sequence[Any], tensors: Sequence[torch.Tensor], what: str, keep: bool = True) -> list[torch.Tensor]:
        """Host copies of ``tensors`` once ``works`` (their receives) have completed; without
        ``keep``, in pinned buffers reused by the next read (for values read at once, such as
        flag bytes: no allocation per receive)."""
        # marked blocked: under TORCH_NCCL_BLOCKING_WAIT=1 these waits block the host
        with torch.cuda.stream(self.stream), self.failure.blocked(what, bounded_here=True):
            for work in works:
                work.wait()  # this stream waits for the receive; the host does not
            hosts = [self._host(index, t, keep) for index, t in enumerate(tensors)]
            for host, tensor in zip(hosts, tensors):
                host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self.failure.block_on(copied, what)
        return hosts

    def _host(self, index: int, tensor: torch.Tensor, keep: bool) -> torch.Tensor:
        if keep:
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        key = (index, tuple(tensor.shape), tensor.dtype)
        host = self._scratch.get(key)
        if host is None:
            host = self._scratch[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host


def link_groups(
    links: Sequence[tuple[int, ...]], device: torch.device, index: int | None, failure: FailureChannel
) -> dict[tuple[str, int, int], Any]:
    """One two-rank process group per link and direction; this rank's, by (direction, peer, tag).

    A link is (upstream, downstream): one communicator per direction carries every boundary
    between those ranks, under tag 0. Or (upstream, downstream, boundary): one per stream
    (``keys.stream_tag``), for a rank holding several stages, whose boundaries with one peer
    the merged orders interleave (``links.plan_streams``). Collective: every rank makes every
    group, in one order. Under NCCL (``index``: the CUDA device's) each group then carries one
    byte in its direction, in that same order, so that every pair is connected before the
    schedule runs (a rank reaching a pair's first operation blocks until the peer does; in
    one global order, the earliest pending pair always has both ranks there).
    """
    rank = dist.get_rank()
    oriented: dict[tuple[int, int, int | None], tuple[int, int]] = {}
    for upstream, downstream, *boundary in links:
        key = (min(upstream, downstream), max(upstream, downstream), boundary[0] if boundary else None)
        oriented.setdefault(key, (upstream, downstream))
    groups: dict[tuple[str, int, int], Any] = {}
    first: list[tuple[Any, int, bool]] = []  # (group, peer, whether this rank sends) in the global order
    for key in sorted(oriented, key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2])):
        low, high, boundary = key
        upstream, downstream = oriented[key]
        for direction in DIRECTIONS:
            group = subgroup([low, high])
            if rank in (low, high):
                peer = downstream if rank == upstream else upstream
                tag = 0 if boundary is None else stream_tag(boundary, Direction(direction))
                groups[(direction, peer, tag)] = group
                sender = upstream if direction == "activation" else downstream
                first.append((group, peer, rank == sender))
    if device.type == "cuda" and first:
        works = []
        # a pair's first operation connects it and blocks the host until the peer gets there
        with failure.blocked("the first message of every link", bounded_here=True):
            for group, peer, sends in first:
                byte = torch.zeros(1, dtype=torch.uint8, device=device)
                works.append((dist.isend if sends else dist.irecv)(byte, peer, group=group))
        failure.wait_on_device(works, "the first message of every link", index)
        done = torch.cuda.Event()
        done.record()
        failure.block_on(done, "the first message of every link")
    return groups


class NcclWire(Wire):
    """One communicator per link and direction, waits on the GPU; see the module docstring.

    ``links``: the (upstream, downstream) rank pairs that may exchange boundary tensors
    (``links.plan_links``), or, for a tagged transport, its streams as (upstream, downstream,
    boundary) (``links.plan_streams``: a communicator per stream, see ``link_groups``); None:
    every pair of ranks of the world, the lower rank taken as upstream (a pair used the
    other way round then connects at its first message).
    """

    name = "nccl"
    short_messages = False
    posts_ahead = False
    batched = True
    zero_flags = False

    def __init__(self, device: torch.device, failure: FailureChannel, links: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__(device, failure)
        self.cuda = device.type == "cuda"
        self.index: int | None = None  # the CUDA device's index, for the failure channel's watchdog
        if self.cuda:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
        if links is None:
            links = list(combinations(range(dist.get_world_size()), 2))
        self.groups = link_groups(links, device, self.index, failure)  # a collective: every rank builds its wire
        self.reader = HostReader(device, failure) if self.cuda else None

    @staticmethod
    def typed(dtype: torch.dtype) -> bool:
        """NCCL's own dtypes travel as themselves; the rest (bool, int16, complex) as bytes."""
        return dtype in NCCL_DTYPES

    def _group(self, direction: str, peer: int, tag: int) -> Any:
        group = self.groups.get((direction, peer, tag))
        if group is None:
            raise RuntimeError(
                f"rank {dist.get_rank()} has no {direction} link to rank {peer} for tag {tag}: the nccl wire was built for other "
                "links than the plan's (Transport(links=...) must list every pair of ranks that exchange rows, "
                "and a tagged transport every stream: links.plan_streams)"
            )
        return group

    def send(self, messages: Sequence[tuple[torch.Tensor, int]], direction: str, tag: int = 0) -> list[tuple[Any, Any]]:
        # NCCL has no tags (a communicator matches by issue order): ``tag`` picks the
        # stream's communicator (0 where one carries every boundary of the link). Issued from the current (compute) stream, which produced the data: NCCL's stream
        # waits for it there, and records the tensor so that its memory outlives the send
        out = []
        for tensor, peer in messages:
            tensor = tensor if tensor.device == self.device else tensor.to(self.device)
            out.append((dist.isend(tensor, peer, group=self._group(direction, peer, tag)), tensor))
        return out

    def wait_sends(self, works: Sequence[Any], what: str) -> None:
        if not self.cuda:  # gloo underneath (the CPU tests): its waits
            super().wait_sends(works, what)

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False, tag: int = 0) -> list[Incoming]:
        if self.reader is None:
            return self._post(specs, direction, control, tag)
        with self.reader.issuing():
            # allocated on the reader's stream too; ``wait`` hands the buffers to the compute stream
            return self._post(specs, direction, control, tag)

    def _post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool, tag: int) -> list[Incoming]:
        out = []
        for peer, spec, flagged in specs:
            buffer = spec.make(self.device, self.zero_flags)
            work = dist.irecv(buffer, peer, group=self._group(direction, peer, tag))
            out.append(Incoming(peer, work, buffer, spec.shape, spec.dtype, flagged, control=control))
        return out

    def wait(self, incoming: Sequence[Incoming], what: str) -> list[tuple[torch.Tensor, int]]:
        if self.reader is None:
            self.failure.wait_all([item.work for item in incoming], what)
            return _with_flags(incoming)
        # the host reads flag bytes and control messages (a layout change changes what to
        # receive next), and waits for those receives alone
        read = [item for item in incoming if item.flagged or item.control]
        values: Any = iter(())
        if read:
            keep = any(item.control for item in read)  # flag bytes alone are read at once: scratch buffers
            tensors = [item.buffer if item.control else item.buffer[-1:] for item in read]
            values = iter(self.reader.read([item.work for item in read], tensors, what, keep))
        data = [item for item in incoming if not item.control]
        if data:  # the compute stream waits for the data, the host goes on
            self.failure.wait_on_device([item.work for item in data], what, self.index)
            compute = torch.cuda.current_stream(self.device)
            for item in data:
                item.buffer.record_stream(compute)
        out = []
        for item in incoming:
            if item.control:
                out.append((next(values), 0))
            else:
                out.append((item.buffer, int(next(values)[0]) if item.flagged else 0))
        return out


def make_wire(wire: str, device: torch.device, failure: FailureChannel, links: Sequence[tuple[int, int]] | None = None) -> Wire:
    """The wire for ``wire`` (``auto`` or forced; see ``choose_wire``); ``links`` for the
    ``nccl`` wire (see ``NcclWire``)."""
    name = choose_wire(wire, device)
    if name == "staged":
        return StagedWire(device, failure)
    if name == "nccl":
        return NcclWire(device, failure, links)
    return Wire(device, failure)


