"""Point-to-point transfer of micro-batch boundaries with split-concat (DAPPLE 5.2.2).

Between stages of different widths each sender holds some rows of a micro-batch and each
receiver needs others; a sender ships to every receiver the rows both hold, and the
receiver concatenates the pieces in row order. Row ranges come from ``slicing``, so both
sides agree on them without negotiation.

One activation transfer is two messages: a fixed-size int64 header (per tensor leaf:
dtype, requires_grad, shape beyond the batch dimension; plus the length of the pytree
spec when it changed, followed by the spec's bytes) and one byte buffer packing every
leaf. A gradient transfer is one byte buffer: its receiver already knows the shapes (it
sent the activations) and only leaves that require grad travel back.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.slicing import flatten, overlap, unflatten

HEADER_INTS = 512
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class Peer:
    """A rank of the adjacent stage and the rows of the micro-batch it holds."""

    rank: int
    rows: tuple[int, int]


@dataclass
class LeafMeta:
    dtype: torch.dtype
    requires_grad: bool
    tail_shape: tuple[int, ...]

    def nbytes(self, rows: int) -> int:
        count = rows
        for dim in self.tail_shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """All tensors as one contiguous byte buffer."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buffer: torch.Tensor, metas: Sequence[LeafMeta], rows: int) -> list[torch.Tensor]:
    out, offset = [], 0
    for meta in metas:
        size = meta.nbytes(rows)
        out.append(buffer[offset : offset + size].view(meta.dtype).reshape(rows, *meta.tail_shape))
        offset += size
    return out


class Transport:
    """Sends and receives boundary tensors of one rank, with bounded waits."""

    def __init__(self, failure: FailureChannel, device: torch.device) -> None:
        self.failure = failure
        self.device = device
        self._spec_sent: dict[int, Any] = {}
        self._spec_received: dict[int, Any] = {}
        self._pending_sends: list[tuple[Any, torch.Tensor, str]] = []
        self.bytes_sent = 0

    # -- sending -------------------------------------------------------------
    def send_activation(self, structure: Any, my_rows: tuple[int, int], peers: Sequence[Peer], what: str) -> None:
        leaves, spec = flatten(structure)
        for leaf in leaves:
            if leaf.dim() == 0 or leaf.shape[0] != my_rows[1] - my_rows[0]:
                from lightning_dapple.errors import DappleConfigError

                raise DappleConfigError(
                    "layer output",
                    f"has a tensor of shape {tuple(leaf.shape)} whose first dimension is not the batch "
                    f"({my_rows[1] - my_rows[0]} rows)",
                    "make every tensor passed between layers batch-first",
                )
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is None:
                continue
            lo, hi = rows[0] - my_rows[0], rows[1] - my_rows[0]
            header, spec_bytes = self._header(leaves, spec, peer.rank)
            self._isend(header, peer.rank, f"header of {what}")
            if spec_bytes is not None:
                self._isend(spec_bytes, peer.rank, f"structure of {what}")
            self._isend(pack([leaf[lo:hi] for leaf in leaves]), peer.rank, what)

    def send_gradient(self, grads: Sequence[torch.Tensor], my_rows: tuple[int, int], peers: Sequence[Peer], what: str) -> None:
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is None:
                continue
            lo, hi = rows[0] - my_rows[0], rows[1] - my_rows[0]
            self._isend(pack([grad[lo:hi] for grad in grads]), peer.rank, what)

    def _header(self, leaves: Sequence[torch.Tensor], spec: Any, peer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec_bytes = None
        if self._spec_sent.get(peer) != spec:
            self._spec_sent[peer] = spec
            spec_bytes = torch.frombuffer(bytearray(pickle.dumps(spec)), dtype=torch.uint8)
        ints = [len(leaves), 0 if spec_bytes is None else spec_bytes.numel()]
        for leaf in leaves:
            if leaf.dtype not in _DTYPE_CODE:
                raise TypeError(f"cannot send tensors of dtype {leaf.dtype} between stages")
            ints += [_DTYPE_CODE[leaf.dtype], int(leaf.requires_grad), leaf.dim() - 1, *leaf.shape[1:]]
        if len(ints) > HEADER_INTS:
            raise ValueError(f"a layer output has too many tensors/dimensions to describe in {HEADER_INTS} ints")
        header = torch.zeros(HEADER_INTS, dtype=torch.int64)
        header[: len(ints)] = torch.tensor(ints, dtype=torch.int64)
        return header, spec_bytes

    def _isend(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        tensor = tensor.to(self.device) if tensor.device != self.device else tensor
        self._pending_sends.append((dist.isend(tensor, peer), tensor, what))
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def flush(self) -> None:
        """Wait for every send issued so far (their buffers may be freed afterwards)."""
        pending, self._pending_sends = self._pending_sends, []
        for work, _tensor, what in pending:
            self.failure.wait(work, f"send of {what}")

    # -- receiving -----------------------------------------------------------
    def _recv(self, tensor: torch.Tensor, peer: int, what: str) -> torch.Tensor:
        self.failure.wait(dist.irecv(tensor, peer), f"{what} from rank {peer}")
        return tensor

    def recv_activation(self, my_rows: tuple[int, int], peers: Sequence[Peer], what: str) -> Any:
        """Receive and concatenate the rows ``my_rows`` of a boundary; grads enabled on
        floating leaves that required grad on the sender."""
        pieces: list[list[torch.Tensor]] = []
        metas: list[LeafMeta] = []
        spec = None
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is None:
                continue
            header = self._recv(torch.empty(HEADER_INTS, dtype=torch.int64, device=self.device), peer.rank, f"header of {what}")
            metas, spec_len = self._parse_header(header.cpu())
            if spec_len:
                raw = self._recv(torch.empty(spec_len, dtype=torch.uint8, device=self.device), peer.rank, f"structure of {what}")
                self._spec_received[peer.rank] = pickle.loads(raw.cpu().numpy().tobytes())
            spec = self._spec_received[peer.rank]
            count = rows[1] - rows[0]
            total = sum(meta.nbytes(count) for meta in metas)
            buffer = self._recv(torch.empty(total, dtype=torch.uint8, device=self.device), peer.rank, what)
            pieces.append(unpack(buffer, metas, count))
        leaves = [parts[0] if len(pieces) == 1 else torch.cat(parts) for parts in zip(*pieces)]
        for leaf, meta in zip(leaves, metas):
            if meta.requires_grad:
                leaf.requires_grad_(True)
        return unflatten(leaves, spec)

    def recv_gradient(self, like: Sequence[torch.Tensor], my_rows: tuple[int, int], peers: Sequence[Peer], what: str) -> list[torch.Tensor]:
        """Gradients for the leaves ``like`` (this rank's outputs that require grad)."""
        metas = [LeafMeta(t.dtype, False, tuple(t.shape[1:])) for t in like]
        pieces = []
        for peer in peers:
            rows = overlap(my_rows, peer.rows)
            if rows is None:
                continue
            count = rows[1] - rows[0]
            total = sum(meta.nbytes(count) for meta in metas)
            buffer = self._recv(torch.empty(total, dtype=torch.uint8, device=self.device), peer.rank, what)
            pieces.append(unpack(buffer, metas, count))
        return [parts[0] if len(pieces) == 1 else torch.cat(parts) for parts in zip(*pieces)]

    @staticmethod
    def _parse_header(header: torch.Tensor) -> tuple[list[LeafMeta], int]:
        ints = header.tolist()
        count, spec_len = ints[0], ints[1]
        metas, pos = [], 2
        for _ in range(count):
            dtype, requires_grad, ndim = _DTYPES[ints[pos]], bool(ints[pos + 1]), ints[pos + 2]
            metas.append(LeafMeta(dtype, requires_grad, tuple(ints[pos + 3 : pos + 3 + ndim])))
            pos += 3 + ndim
        return metas, spec_len
