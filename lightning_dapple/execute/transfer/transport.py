"""Point-to-point transfer of micro-batch boundaries with split-concat (DAPPLE 5.2.2).

Between stages of different widths each sender holds some rows of a micro-batch and each
receiver needs others; a sender ships to every receiver the rows both hold, and the
receiver concatenates the pieces in row order. Row ranges come from ``slicing``, so both
sides agree on them without negotiation.

An activation transfer is one message once both sides know its layout. Each side remembers,
per peer, the layout (dtype, requires_grad and shape beyond the batch dimension of every
leaf, and the pytree structure) of the last activation that went between them, so the
receiver can post a receive of the right size: the leaves' bytes plus one flag byte, zeroed
("same layout"). When the layout changes (the first transfer, or e.g. an eval pass where
nothing requires grad), the sender first sends a message that fills the whole receive with
the flag byte set, then a fixed-size int64 header describing the new layout (followed by the
structure when that changed too) and the data.

In the steady state, what the sender sends depends on the wire policy (``wires``: chosen
once per Transport from the backend and device, or forced with ``wire=``):
* under gloo (the ``gloo`` and ``staged`` wires), which accepts a message shorter than the
  receive posted for it and leaves the rest of the buffer as it was, the sender sends the
  stage output itself (a lone tensor goes as it is, several are packed), and the
  receiver's flag byte stays "same";
* under NCCL (the ``nccl`` wire), which needs equal sizes, every message carries its flag
  byte, and each message goes on the communicator of its link and direction.

Per-message overhead is what a pipeline of small stages pays most for (DAPPLE 5.2: the
schedule only helps if the transfers between stages stay cheap), so the steady state is one
round trip per transfer, with as few tensor operations as possible. Between the GEMMs and
gloo calls of a loaded step each operation costs far more than alone
(``benchmarks/step_breakdown.py --clock cpu``).

Transfers are named by a hashable key: the executor's ``keys.TransferKey`` (boundary,
micro-batch, direction), equal on both ends. Pending sends are waited by key (``settle``) and
receives posted ahead are filed by key; ``str()`` of the key labels wait messages.

A gradient transfer is one message: its receiver already knows the shapes (it sent the
activations) and only leaves that require grad travel back. A lone gradient is sent as it
is and received straight into a tensor of its dtype and shape, unless the wire has no such
type (complex never travels typed, bool not under NCCL): then it goes as bytes.

Whole values (``profile.sample_rows``: a 0-d tensor, or a first dimension of 1 beside a
larger slice, such as a (1, T, n) rotary table or a (1, 1, T, T) mask) are not cut: a
receiver gets one from the sender that holds its first row (``first`` below; both sides
know it from the rows alone) and uses it as it is, the other senders leave it out of their
message. Its gradient (the sum over the receiver's rows) goes back to that sender only, and
a sender adds up what its receivers return (``torch.distributed.pipelining`` passes such
values unsplit too). The layout header marks each leaf whole or per-sample.

A sender whose slice is one row cannot tell a whole value of shape (1, ...) from its one
row of a per-sample value; it marks such a leaf per-sample and sends its row to its one
receiver. The receiver decides, from what it knows without asking:

* if some sender marked the leaf whole, it is whole: the receiver takes the piece of the
  sender of its first row (that piece is the whole value either way), and returns the
  gradient to that sender and zeros of one row to the other one-row senders, which expect
  a row; a sender of several rows that marked it per-sample contradicts this and is refused;
* otherwise it is per-sample and the pieces are concatenated. This includes a receiver of
  one row (both readings give the same tensor from the same sender) and a receiver of
  several rows whose senders all hold one row: there no shape can tell, and a whole value
  arrives repeated once per row, (rows, ...). Its gradient is still exact (each copy's row
  goes back to the sender that sent it), and a model that broadcasts the value over the
  batch computes the same; one that needs the (1, ...) shape gets it with slices of at
  least two rows per sending replica.

The module is long because both ends of a transfer (the layout cache, the header, split-concat
of the rows and the two wire policies) must agree byte for byte; they are kept in one place
so that a change to one end is seen at the other.
"""
from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.transfer.keys import TransferKey, stream_tag
from lightning_dapple.execute.slicing import flatten, overlap, unflatten
from lightning_dapple.execute.transfer.wires import Incoming, Wire, make_wire
from lightning_dapple.profile.sample_rows import is_whole

HEADER_INTS = 512
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def _spec_to_bytes(spec: Any) -> bytes:
    """A pytree structure as bytes: pytree's own JSON form where it has one (unpickling a
    leaf spec is deprecated in torch), pickle for node types it cannot name."""
    try:
        return b"J" + pytree.treespec_dumps(spec).encode()
    except (TypeError, NotImplementedError):
        return b"P" + pickle.dumps(spec)


def _spec_from_bytes(raw: bytes) -> Any:
    if raw[:1] == b"J":
        return pytree.treespec_loads(raw[1:].decode())
    with warnings.catch_warnings():  # torch's own leaf specs warn when unpickled
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(raw[1:])


def receives_ahead_pay(device: torch.device, local_ranks: int | None = None, threads: int | None = None, merged_order: bool = False) -> bool:
    """Whether posting receives one transfer ahead (DAPPLE 5.2: overlap transfers with
    compute) speeds this rank up rather than slowing it down.

    * Only under gloo. Under NCCL a receive starts as soon as it is posted, whatever compute
      is queued (``wires.NcclWire``), and the host, whose kernel launches return at once,
      reaches a receive action before the GPU has run the compute queued ahead of it: the
      transfer overlaps that compute without posting ahead, and the ``nccl`` wire never does.
    * For one stage per rank, only when the machine has a core left for every rank's gloo
      I/O thread. gloo sends a message's data once its receive is posted; with the receive
      posted ahead the data arrives while the receiver computes, and gloo's loop thread must
      run then. With every core already computing it preempts the compute, and the step gets
      no faster or slower (``benchmarks/bench_schedules.py``, its ``dapple-ahead`` row, 2
      ranks on 2 cores).
    * For a rank's merged order of several stages (``merged_order``: interleaved, ZB-V),
      whenever every rank has a core. Such a rank hands twice the messages per step to the
      same peer, in both directions, and there the early receives measured faster than the
      I/O thread's preemption costs (``bench_schedules.py --chunks 2 --due-ablation``, 2
      ranks on 2 cores: interleaved 0.5-4 % faster, ZB-V within 1 %).

    ``local_ranks`` defaults to ``LOCAL_WORLD_SIZE`` (else the world size: every rank on this
    machine), ``threads`` to ``torch.get_num_threads()``.
    """
    if device.type != "cpu" or not dist.is_initialized() or dist.get_backend() != "gloo":
        return False
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if threads is None:
        threads = torch.get_num_threads()
    io_threads = 0 if merged_order else 1
    return (os.cpu_count() or 1) >= local_ranks * (threads + io_threads)


@dataclass(frozen=True)
class Peer:
    """A rank of the adjacent stage and the rows of the micro-batch it holds."""

    rank: int
    rows: tuple[int, int]


class LeafMeta(NamedTuple):
    """One tensor leaf's layout: ``shape`` is a per-sample leaf's shape after its rows, a
    whole leaf's whole shape. A named tuple rather than a dataclass: one is built per leaf
    and transfer on the per-micro-batch path, where construction cost shows."""

    dtype: torch.dtype
    requires_grad: bool
    shape: tuple[int, ...]
    whole: bool = False

    def nbytes(self, rows: int) -> int:
        """Bytes of the leaf in a piece of ``rows`` rows (a whole leaf's own)."""
        count = 1 if self.whole else rows
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    def piece_shape(self, rows: int) -> tuple[int, ...]:
        return self.shape if self.whole else (rows, *self.shape)


FLAG_SAME_LAYOUT = 0
FLAG_NEW_LAYOUT = 1
_FLAGS = {flag: torch.tensor([flag], dtype=torch.uint8) for flag in (FLAG_SAME_LAYOUT, FLAG_NEW_LAYOUT)}  # cat copies them


def _meta_of(leaf: torch.Tensor, rows: int | None = None) -> LeafMeta:
    """The layout of ``leaf`` on a slice of ``rows`` rows (None: the leaf's own first
    dimension, so only a 0-d leaf is whole)."""
    if leaf.dtype not in _DTYPE_CODE:
        raise TypeError(f"cannot send tensors of dtype {leaf.dtype} between stages")
    shape = leaf.shape
    if is_whole(shape, rows if rows is not None else (shape[0] if shape else 0)):
        return LeafMeta(leaf.dtype, leaf.requires_grad, tuple(shape), True)
    if rows is not None and shape[0] != rows:
        raise DappleConfigError(
            "layer output",
            f"has a tensor of shape {tuple(shape)} whose first dimension is neither the batch ({rows} rows) nor 1",
            "make every tensor passed between layers batch-first, or give a value that is the same for every sample "
            "a first dimension of 1 (it then travels whole)",
        )
    return LeafMeta(leaf.dtype, leaf.requires_grad, tuple(shape[1:]))


def _carried(metas: Sequence[LeafMeta], first: bool) -> Sequence[LeafMeta]:
    """The leaves a piece carries: the per-sample ones, and the whole ones when its sender
    holds the receiver's ``first`` row."""
    return metas if first else [meta for meta in metas if not meta.whole]


def _payload_bytes(metas: Sequence[LeafMeta], rows: int, first: bool = True) -> int:
    return sum(meta.nbytes(rows) for meta in _carried(metas, first))


def pack(tensors: Sequence[torch.Tensor], flag: int | None = None) -> torch.Tensor:
    """All tensors as one contiguous byte buffer, with a trailing ``flag`` byte if given."""
    # contiguous() first: a flattened view of e.g. an expanded (stride-0) gradient or a column
    # slice is not a dense byte range
    parts = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    if flag is not None:
        device = parts[0].device if parts else torch.device("cpu")
        parts.append(_FLAGS[flag] if device.type == "cpu" else torch.full((1,), flag, dtype=torch.uint8, device=device))
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def unpack(buffer: torch.Tensor, metas: Sequence[LeafMeta], rows: int, first: bool = True) -> list[torch.Tensor | None]:
    """The leaves of a piece of ``rows`` rows, None for whole leaves it does not carry."""
    out: list[torch.Tensor | None] = []
    offset = 0
    for meta in metas:
        if meta.whole and not first:
            out.append(None)
            continue
        size = meta.nbytes(rows)
        chunk = buffer[offset : offset + size]
        if offset % meta.dtype.itemsize:  # after leaves of smaller items: copy to an aligned start
            chunk = chunk.clone()
        out.append(chunk.view(meta.dtype).reshape(meta.piece_shape(rows)))
        offset += size
    return out


def _as_is(dtype: torch.dtype) -> bool:
    """Whether a lone tensor of ``dtype`` travels in its own dtype (else as bytes): complex
    never does (NCCL has no complex type); the ``nccl`` wire also sends bool as bytes."""
    return not dtype.is_complex


def as_message(tensors: Sequence[torch.Tensor], typed: Callable[[torch.dtype], bool] = _as_is) -> torch.Tensor:
    """What to send for ``tensors``: a lone tensor as it is (no copy; the receiver knows its
    dtype and shape) if its dtype travels ``typed``; otherwise, and several tensors, packed
    into one byte buffer."""
    if len(tensors) == 1 and typed(tensors[0].dtype):
        tensor = tensors[0]
        return tensor if tensor.is_contiguous() else tensor.contiguous()
    return pack(tensors)


def short_messages_match() -> bool:
    """Whether a message may be shorter than the receive posted for it, leaving the rest of
    the receive buffer as it was. gloo allows it (a message's length must not exceed the
    posted buffer; ``tests/test_transport.py`` checks the behaviour); NCCL requires equal
    counts, so there every activation keeps its flag byte."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


class BufferSpec(NamedTuple):
    """A receive buffer: its shape and dtype, and whether it starts zeroed (an activation's
    trailing flag byte must read "same layout" when a short message leaves it untouched).
    A named tuple, like ``LeafMeta``: one is built per receive."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    zeroed: bool = False

    def make(self, device: torch.device, zero: bool = True) -> torch.Tensor:
        """The buffer; zeroed only if it asks to be and the wire sends short messages (``zero``)."""
        make = torch.zeros if (self.zeroed and zero) else torch.empty
        return make(self.shape, dtype=self.dtype, device=device)

    def nbytes(self) -> int:
        count = self.dtype.itemsize
        for dim in self.shape:
            count *= dim
        return count


def _activation_buffer(metas: Sequence[LeafMeta], rows: int, first: bool) -> BufferSpec:
    """The carried leaves' bytes and a flag byte, zeroed (FLAG_SAME_LAYOUT)."""
    return BufferSpec((_payload_bytes(metas, rows, first) + 1,), torch.uint8, zeroed=True)


def _typed_gradient(metas: Sequence[LeafMeta], typed: Callable[[torch.dtype], bool] = _as_is) -> bool:
    """Whether gradients of these leaves arrive in their own dtype and shape (one leaf that
    travels as is, see ``as_message``) rather than as bytes to unpack."""
    return len(metas) == 1 and typed(metas[0].dtype)


def _gradient_buffer(metas: Sequence[LeafMeta], rows: int, typed: bool) -> BufferSpec:
    """The receive of the gradients of the carried leaves ``metas`` for ``rows`` rows."""
    if typed:
        return BufferSpec(metas[0].piece_shape(rows), metas[0].dtype)
    return BufferSpec((_payload_bytes(metas, rows),), torch.uint8)


def _rows_of(tensors: Sequence[torch.Tensor], metas: Sequence[LeafMeta], lo: int, hi: int, first: bool) -> list[torch.Tensor]:
    """What a piece carries: rows ``[lo, hi)`` of each per-sample tensor (the tensor itself
    when that is all of it), and each whole tensor as it is when ``first``."""
    out = []
    for tensor, meta in zip(tensors, metas):
        if meta.whole:
            if first:
                out.append(tensor)
        elif lo == 0 and hi == tensor.shape[0]:
            out.append(tensor)
        else:
            out.append(tensor[lo:hi])
    return out


def _gradient_piece(grads: Sequence[torch.Tensor], rows: int, lo: int, hi: int, first: bool, sender_rows: int) -> list[torch.Tensor]:
    """The gradients one sender of an activation gets back from a receiver of ``rows`` rows
    (module docstring): rows ``[lo, hi)`` of per-sample ones; a whole one's gradient if it
    sent this receiver's ``first`` row, zeros of its one row if it holds one row and marked
    the leaf per-sample, else nothing."""
    out = []
    for grad in grads:
        if not is_whole(grad.shape, rows):
            out.append(grad if lo == 0 and hi == rows else grad[lo:hi])
        elif first:
            out.append(grad)
        elif sender_rows == 1 and grad.dim() > 0:
            out.append(torch.zeros_like(grad))
    return out


def _settle_pieces(pieces: list[list[torch.Tensor | None]], layouts: list[Sequence[LeafMeta]], senders: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The receiver's leaves from the pieces of several senders (in row order; ``senders``:
    each one's rank and slice rows): per-sample leaves concatenated, whole ones taken from
    the first piece, by the rule of the module docstring."""
    if not any(meta.whole for metas in layouts for meta in metas):
        return [torch.cat(parts) for parts in zip(*pieces)]  # type: ignore[arg-type]
    leaves = []
    for index in range(len(layouts[0])):
        kinds = [metas[index] for metas in layouts]
        marked = next((rank for meta, (rank, _) in zip(kinds, senders) if meta.whole), None)
        if marked is None:
            leaves.append(torch.cat([piece[index] for piece in pieces]))  # type: ignore[misc]
            continue
        for meta, (rank, rows) in zip(kinds, senders):
            if not meta.whole and rows > 1:
                raise DappleConfigError(
                    "layer output",
                    f"tensor {index} is per-sample on rank {rank} (rows first) and whole on rank {marked} (first dimension 1 or none)",
                    "give the value the same kind on every slice: batch-first, or a first dimension of 1 for a value shared by all samples",
                )
        leaf = pieces[0][index]
        if leaf is None:  # the sender of the first row always carries every leaf
            raise RuntimeError(f"rank {senders[0][0]} sent no copy of whole tensor {index}; the two sides disagree on the rows")
        shape = next(meta.shape for meta in kinds if meta.whole)
        if tuple(leaf.shape) != shape:
            raise DappleConfigError(
                "layer output",
                f"tensor {index} is whole of shape {shape} on rank {marked} but of shape {tuple(leaf.shape)} on rank {senders[0][0]}",
                "give a value shared by all samples the same shape on every slice",
            )
        leaves.append(leaf)
    return leaves


class Transport:
    """Sends and receives boundary tensors of one rank, with bounded waits.

    ``wire`` picks how messages travel (``lightning_dapple.execute.transfer.wires``): ``"auto"``
    chooses from the backend and device (gloo with CPU tensors: ``gloo``; gloo with CUDA
    tensors: ``staged`` through pinned host buffers; NCCL: ``nccl``, one communicator per
    link and direction); a forced ``"nccl"`` or ``"staged"`` also runs over gloo with CPU
    tensors, which is how the CPU tests cover those paths. Every rank must use the same
    policy (``gloo`` and ``staged`` messages are alike, so those two can mix). With the
    ``nccl`` wire the constructor is collective: every rank builds its Transport at the same
    point, with the same ``links`` (the rank pairs that exchange rows, ``links.plan_links``;
    for a ``tagged`` transport its streams, ``links.plan_streams``; None: every pair), and it
    creates one process group per link (or stream) and direction.
    """

    def __init__(
        self,
        failure: FailureChannel,
        device: torch.device,
        short_messages: bool | None = None,
        wire: str | Wire = "auto",
        links: Sequence[tuple[int, int]] | None = None,
        tagged: bool = False,
    ) -> None:
        self.failure = failure
        # a tag per boundary and direction (``_tag``): a rank holding several stages exchanges
        # several boundaries with one peer, whose messages its peer takes in another order
        self.tagged = tagged
        self.device = device
        # a Wire instance is used as it is (the overhead probe's loopback, no process group)
        self.wire = wire if isinstance(wire, Wire) else make_wire(wire, device, failure, links)
        # whether a known layout's activation may travel without its flag byte (see
        # ``short_messages_match``); None: what the wire allows
        self.short = self.wire.short_messages if short_messages is None else short_messages
        require(
            self.wire.short_messages or not self.short,
            "short_messages",
            f"the {self.wire.name} wire needs every message to fill its receive",
            "leave short_messages unset",
        )
        self._typed = self.wire.typed
        # batched wires collect a transfer's messages here and issue them together
        self._batch: list[tuple[torch.Tensor, int, Any, Hashable]] | None = [] if self.wire.batched else None
        # per (peer, tag): the layout of the last activation sent to / received from it
        self._layout_sent: dict[tuple[int, int], tuple[tuple[LeafMeta, ...], Any]] = {}
        self._layout_received: dict[tuple[int, int], tuple[tuple[LeafMeta, ...], Any]] = {}
        # sends not yet waited: (work or None, what to keep until then, label, settle key);
        # ``settle`` and ``flush`` wait them
        self._pending_sends: list[tuple[Any, Any, Any, Hashable]] = []
        # receives posted ahead of their action, by transfer key
        self._posted: dict[Hashable, list[Incoming]] = {}
        # str() of each transfer key, for wait messages: a key's label is made once, not per
        # message (the executor's keys are a fixed set per plan)
        self._labels: dict[Hashable, str] = {}
        self.bytes_sent = 0
        self.messages_sent = 0

    def _tag(self, transfer: Hashable) -> int:
        """The tag of ``transfer``'s messages: 0, or (``tagged``, for ``keys.TransferKey``s) one
        per boundary and direction, above the results' tag. Each such stream carries its
        micro-batches in the same order at both ends, as every schedule's stage lists do."""
        if not self.tagged:
            return 0
        assert isinstance(transfer, TransferKey), transfer
        return stream_tag(transfer.boundary, transfer.direction)

    @property
    def posts_ahead(self) -> bool:
        """Whether receives may be posted ahead on this wire (not under NCCL: see
        ``receives_ahead_pay``)."""
        return self.wire.posts_ahead

    # -- sending -------------------------------------------------------------
    def send_activation(
        self, structure: Any, my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable, key: Hashable = None
    ) -> None:
        """Send the rows of ``structure`` each peer holds; ``settle`` finds the sends by ``key``
        (``transfer`` when not given)."""
        if key is None:
            key = transfer
        leaves, spec = flatten(structure)
        count = my_rows[1] - my_rows[0]
        metas = tuple(_meta_of(leaf, count) for leaf in leaves)
        tag = self._tag(transfer)
        try:
            for peer in peers:
                rows = overlap(my_rows, peer.rows)
                if rows is not None:
                    lo, hi = rows[0] - my_rows[0], rows[1] - my_rows[0]
                    self._send_rows(leaves, metas, spec, lo, hi, rows[0] == peer.rows[0], peer.rank, transfer, key, tag)
        finally:
            if self._batch:
                self._issue("activation", tag)

    def _send_rows(
        self,
        leaves: list[torch.Tensor],
        metas: tuple[LeafMeta, ...],
        spec: Any,
        lo: int,
        hi: int,
        first: bool,
        peer: int,
        transfer: Hashable,
        key: Hashable,
        tag: int,
    ) -> None:
        """The messages of one activation transfer to one peer (see the module docstring);
        ``first``: this rank holds the peer's first row (whole leaves go along)."""
        data = _rows_of(leaves, metas, lo, hi, first)
        known = self._layout_sent.get((peer, tag))
        if known == (metas, spec):
            if self.short and _payload_bytes(metas, hi - lo, first):
                self._isend(as_message(data, self._typed), peer, transfer, key, tag)  # the receiver's flag byte stays "same"
            else:
                self._isend(pack(data, FLAG_SAME_LAYOUT), peer, transfer, key, tag)
            return
        if known is not None:  # the receiver expects the old layout's size: tell it to read a header
            filler = torch.zeros(_payload_bytes(known[0], hi - lo, first) + 1, dtype=torch.uint8)
            filler[-1] = FLAG_NEW_LAYOUT
            self._isend(filler, peer, f"layout change of {transfer}", key, tag)
        header, spec_bytes = self._header(metas, spec, send_spec=known is None or known[1] != spec)
        self._layout_sent[(peer, tag)] = (metas, spec)
        self._isend(header, peer, f"header of {transfer}", key, tag)
        if spec_bytes is not None:
            self._isend(spec_bytes, peer, f"structure of {transfer}", key, tag)
        self._isend(pack(data), peer, transfer, key, tag)

    def send_gradient(
        self, grads: Sequence[torch.Tensor], my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable, key: Hashable = None
    ) -> None:
        """Send the rows of ``grads`` each peer holds; ``settle`` finds the sends by ``key``
        (``transfer`` when not given)."""
        if key is None:
            key = transfer
        count = my_rows[1] - my_rows[0]
        tag = self._tag(transfer)
        try:
            for peer in peers:
                rows = overlap(my_rows, peer.rows)
                if rows is None:
                    continue
                lo, hi = rows[0] - my_rows[0], rows[1] - my_rows[0]
                piece = _gradient_piece(grads, count, lo, hi, rows[0] == my_rows[0], peer.rows[1] - peer.rows[0])
                self._isend(as_message(piece, self._typed), peer.rank, transfer, key, tag)
        finally:
            if self._batch:
                self._issue("gradient", tag)

    @staticmethod
    def _header(metas: Sequence[LeafMeta], spec: Any, send_spec: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec_bytes = None
        if send_spec:
            spec_bytes = torch.frombuffer(bytearray(_spec_to_bytes(spec)), dtype=torch.uint8)
        ints = [len(metas), 0 if spec_bytes is None else spec_bytes.numel()]
        for meta in metas:
            ints += [_DTYPE_CODE[meta.dtype], int(meta.requires_grad), int(meta.whole), len(meta.shape), *meta.shape]
        if len(ints) > HEADER_INTS:
            raise ValueError(f"a layer output has too many tensors/dimensions to describe in {HEADER_INTS} ints")
        header = torch.zeros(HEADER_INTS, dtype=torch.int64)
        header[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
        return header, spec_bytes

    def _isend(self, tensor: torch.Tensor, peer: int, label: Any, key: Hashable, tag: int = 0) -> None:
        """Send one message now, or (batched wires) add it to the transfer's batch; ``label``
        (a transfer key or a string) names it in wait messages."""
        if self._batch is not None:
            self._batch.append((tensor, peer, label, key))
            return
        work, kept = self.wire.send_one(tensor, peer, tag)
        self._pending_sends.append((work, kept, label, key))
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages_sent += 1

    def _issue(self, direction: str, tag: int = 0) -> None:
        """Issue the batch of messages collected for one transfer."""
        batch, self._batch = self._batch or [], []
        sent = self.wire.send([(tensor, peer) for tensor, peer, _, _ in batch], direction, tag)
        for (work, kept), (tensor, _, label, key) in zip(sent, batch):
            self._pending_sends.append((work, kept, label, key))
            self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages_sent += len(batch)

    def flush(self) -> None:
        """Wait for every send issued so far (their buffers may be freed afterwards)."""
        pending, self._pending_sends = self._pending_sends, []
        self._wait_sends(pending)

    def settle(self, keys: Any) -> None:
        """Wait for the pending sends whose key is in ``keys`` (``schedule.settle`` says which
        a receive may wait for: those the peer has already posted receives for), so gloo
        writes their data while this rank is blocked rather than during its next compute
        (under NCCL nothing waits for a send: ``wires.NcclWire``)."""
        if not keys or not self._pending_sends:
            return
        due = [item for item in self._pending_sends if item[3] in keys]
        if due:
            self._pending_sends = [item for item in self._pending_sends if item[3] not in keys]
            self._wait_sends(due)

    def _wait_sends(self, pending: list[tuple[Any, Any, Any, Hashable]]) -> None:
        if pending:
            first = self._labels.get(pending[0][2]) or self._label(pending[0][2])
            what = first if len(pending) == 1 else f"{len(pending)} sends ({first} ... {pending[-1][2]})"
            self.wire.wait_sends([item[0] for item in pending], what)
            if self.wire.pooled:
                self.wire.release([item[1] for item in pending])

    def _label(self, transfer: Any) -> str:
        label = self._labels[transfer] = str(transfer)
        return label

    # -- receiving -----------------------------------------------------------
    def _recv_now(self, spec: BufferSpec, peer: int, what: str, tag: int, control: bool = False) -> torch.Tensor:
        """One message of an activation transfer from ``peer``, received now (``control``:
        a header or structure, read on the host)."""
        incoming = self.wire.post([(peer, spec, False)], "activation", control, tag)
        return self.wire.wait(incoming, f"{what} from rank {peer}")[0][0]

    # -- receiving ahead -----------------------------------------------------
    # A receive posted before the rank needs it lets the data arrive while the rank computes
    # (DAPPLE 5.2: communication overlapped with computation); without it every transfer
    # starts only when its receiver asks. Sizes must be known to post: an activation's from
    # the layout of the last one from the same peer (a changed layout arrives as a message
    # of that size with the flag set, see the module docstring), a gradient's from the
    # outputs it belongs to. Callers post in the order of their action list and at most one
    # transfer ahead, so receives from one peer are matched in order. The nccl wire never
    # posts ahead (see ``receives_ahead_pay``): there posting is a no-op and the receive is
    # posted when due.
    def post_activation(self, my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable) -> bool:
        """Post the receives of activation ``transfer`` now; False if a layout is still unknown
        (or the wire does not post ahead)."""
        if not self.wire.posts_ahead:
            return False
        specs = self._activation_specs(my_rows, peers, self._tag(transfer))
        if specs is None:
            return False
        self._post(transfer, specs, "activation")
        return True

    def _activation_specs(self, my_rows: tuple[int, int], peers: Sequence[Peer], tag: int) -> list[tuple[int, BufferSpec, bool]] | None:
        """The receives of an activation from ``peers``; None if a peer's layout is unknown."""
        specs = []
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is None:
                continue
            known = self._layout_received.get((peer.rank, tag))
            if known is None:
                return None
            specs.append((peer.rank, _activation_buffer(known[0], rows[1] - rows[0], rows[0] == my_rows[0]), True))
        return specs

    def post_gradient(self, like: Sequence[torch.Tensor], my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable) -> None:
        """Post the receives of gradient ``transfer`` (for this rank's outputs ``like``) now
        (nothing on a wire that does not post ahead)."""
        if self.wire.posts_ahead:
            count = my_rows[1] - my_rows[0]
            self._post(transfer, self._gradient_specs([_meta_of(t, count) for t in like], my_rows, peers)[0], "gradient")

    def _gradient_specs(
        self, metas: Sequence[LeafMeta], my_rows: tuple[int, int], peers: Sequence[Peer]
    ) -> tuple[list[tuple[int, BufferSpec, bool]], list[tuple[int, bool]]]:
        """The receives of a gradient from ``peers``, and per receive the rows it brings and
        whether this rank sent that peer its first row (its whole leaves' gradients come)."""
        specs, pieces = [], []
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is not None:
                first = rows[0] == peer.rows[0]
                carried = _carried(metas, first)
                specs.append((peer.rank, _gradient_buffer(carried, rows[1] - rows[0], _typed_gradient(carried, self._typed)), False))
                pieces.append((rows[1] - rows[0], first))
        return specs, pieces

    def _post(self, transfer: Hashable, specs: list[tuple[int, BufferSpec, bool]], direction: str) -> None:
        if transfer in self._posted:
            raise RuntimeError(f"receives of {transfer} were already posted")
        self._posted[transfer] = self.wire.post(specs, direction, tag=self._tag(transfer))

    def is_posted(self, transfer: Hashable) -> bool:
        """Whether the receives of ``transfer`` were posted ahead and not yet taken."""
        return transfer in self._posted

    def recv_activation(self, my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable) -> Any:
        """Receive and concatenate the rows ``my_rows`` of a boundary; grads enabled on
        floating leaves that required grad on the sender.

        The receives of every peer whose layout is known are posted together and waited
        together; a peer whose flag byte says "new layout" (or whose layout is unknown) then
        sends a header, maybe the structure, and the data. Whole leaves come from the peer of
        this rank's first row (module docstring)."""
        parts = []
        tag = self._tag(transfer)
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is not None:
                first = rows[0] == my_rows[0]
                parts.append((peer.rank, rows[1] - rows[0], self._layout_received.get((peer.rank, tag)), first, peer.rows[1] - peer.rows[0]))
        posted = self._posted.pop(transfer, None)
        if posted is None:
            specs = [(rank, _activation_buffer(known[0], count, first), True) for rank, count, known, first, _ in parts if known is not None]
            posted = self.wire.post(specs, "activation", tag=tag) if specs else []
        label = self._labels.get(transfer) or self._label(transfer)
        received = iter(self.wire.wait(posted, _from(label, posted)) if posted else ())
        pieces: list[list[torch.Tensor | None]] = []
        layouts: list[Sequence[LeafMeta]] = []
        spec = None
        for rank, count, known, first, _ in parts:
            buffer = None
            if known is not None:
                message, flag = next(received)
                if flag == FLAG_SAME_LAYOUT:
                    buffer = message  # unpack reads the leaves' bytes and leaves the flag byte
            if buffer is None:
                known = self._recv_layout(rank, known, label, tag)
                buffer = self._recv_now(BufferSpec((_payload_bytes(known[0], count, first),), torch.uint8), rank, label, tag)
            metas, spec = known
            layouts.append(metas)
            pieces.append(unpack(buffer, metas, count, first))
        if len(pieces) == 1:
            leaves = pieces[0]  # one sender: it holds the first row, so it carried every leaf
        else:
            leaves = _settle_pieces(pieces, layouts, [(rank, rows) for rank, _, _, _, rows in parts])
        for leaf, meta in zip(leaves, layouts[0] if layouts else ()):
            if meta.requires_grad:
                leaf.requires_grad_(True)  # type: ignore[union-attr]
        return unflatten(leaves, spec)  # type: ignore[arg-type]

    def _recv_layout(self, peer: int, known: tuple[tuple[LeafMeta, ...], Any] | None, what: str, tag: int) -> tuple[tuple[LeafMeta, ...], Any]:
        """Receive a header (and the structure if it changed) and remember the layout."""
        header = self._recv_now(BufferSpec((HEADER_INTS,), torch.int64), peer, f"header of {what}", tag, control=True)
        metas, spec_len = self._parse_header(header.cpu())
        if spec_len:
            raw = self._recv_now(BufferSpec((spec_len,), torch.uint8), peer, f"structure of {what}", tag, control=True)
            spec = _spec_from_bytes(raw.cpu().numpy().tobytes())
        elif known is not None:
            spec = known[1]
        else:
            raise RuntimeError(f"rank {peer} sent {what} without its structure; the two sides' layout caches disagree")
        layout = (tuple(metas), spec)
        self._layout_received[(peer, tag)] = layout
        return layout

    def recv_gradient(
        self, like: Sequence[torch.Tensor], my_rows: tuple[int, int], peers: Sequence[Peer], transfer: Hashable
    ) -> list[torch.Tensor]:
        """Gradients for the leaves ``like`` (this rank's outputs that require grad): rows
        concatenated; a whole leaf's summed over the receivers it was sent to (zeros if it
        went to none)."""
        count = my_rows[1] - my_rows[0]
        metas = [_meta_of(t, count) for t in like]
        specs, counts = self._gradient_specs(metas, my_rows, peers)
        posted = self._posted.pop(transfer, None)
        if posted is None:
            posted = self.wire.post(specs, "gradient", tag=self._tag(transfer))
        label = self._labels.get(transfer) or self._label(transfer)
        received = self.wire.wait(posted, _from(label, posted)) if posted else []
        pieces = [self._gradient_leaves(buffer, metas, rows, first) for (buffer, _), (rows, first) in zip(received, counts)]
        if not any(meta.whole for meta in metas):
            return [parts[0] if len(pieces) == 1 else torch.cat(parts) for parts in zip(*pieces)]  # type: ignore[arg-type]
        grads = []
        for leaf, meta, parts in zip(like, metas, zip(*pieces)):
            got = [part for part in parts if part is not None]
            if not meta.whole:
                grads.append(got[0] if len(got) == 1 else torch.cat(got))
            elif not got:
                grads.append(torch.zeros_like(leaf))
            else:
                total = got[0]
                for part in got[1:]:
                    total = total + part
                grads.append(total)
        return grads

    def _gradient_leaves(self, buffer: torch.Tensor, metas: Sequence[LeafMeta], rows: int, first: bool) -> list[torch.Tensor | None]:
        """One receiver's piece of a gradient transfer, per leaf (None: not carried)."""
        carried = _carried(metas, first)
        if not _typed_gradient(carried, self._typed):
            return unpack(buffer, metas, rows, first)
        return [buffer if first or not meta.whole else None for meta in metas]

    @staticmethod
    def _parse_header(header: torch.Tensor) -> tuple[list[LeafMeta], int]:
        ints = header.tolist()
        count, spec_len = ints[0], ints[1]
        metas, pos = [], 2
        for _ in range(count):
            dtype, requires_grad, whole, ndim = _DTYPES[ints[pos]], bool(ints[pos + 1]), bool(ints[pos + 2]), ints[pos + 3]
            metas.append(LeafMeta(dtype, requires_grad, tuple(ints[pos + 4 : pos + 4 + ndim]), whole))
            pos += 4 + ndim
        return metas, spec_len


def _from(what: str, incoming: Sequence[Incoming]) -> str:
    """``what`` and the ranks it comes from, for wait messages."""
    if len(incoming) == 1:
        return f"{what} from rank {incoming[0].peer}"
    return f"{what} from ranks {', '.join(str(item.peer) for item in incoming)}"
