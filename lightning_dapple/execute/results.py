"""The end of a step: the last stage's loss and logged objects, on every rank of the plan.

Lightning shows the training loss on rank 0 (a first-stage rank), so every step ends with
the last stage handing its results to all ranks. That hand-off sits on every rank's
critical path, and an earlier design (a ``broadcast`` through the process group) cost two
things a pipeline step cannot afford on a small machine: gloo runs collectives on its
worker threads (extra thread hops per step), and the broadcast's root blocks until the
slowest receiver has arrived -- in a 1F1B schedule the last stage finishes well before the
first (DAPPLE 3.2, the cool-down), so it idled there every step.

Instead the results travel point to point under their own tag:

* last-stage replicas send their (loss, payload size) head and their pickled objects to the
  first of them (the source);
* the source sends the combined head (and payload, only when something was logged) to every
  other rank of the plan and does not wait: its sends are waited at the start of the next
  hand-off (or by ``flush``), so the source goes on at once;
* every other rank receives the head. Where the backend matches point-to-point messages by
  tag (gloo) it posts that receive when the step starts (``post``), so the head has already
  arrived when the rank finishes its last backward; backends that match by order alone
  (NCCL) post it at the end, after every schedule receive from the same peer.

The messages are a few bytes, so under gloo they travel in host memory whatever the
stage's device (gloo cannot send CUDA tensors; several ranks sharing one GPU run gloo),
and on the device under NCCL, which only moves device memory. There the host waits for the
head (and payload) alone, not for the compute stream: receives are issued from a stream
with nothing queued and read through pinned copies on it (``wires.HostReader``, bounded by
the failure channel's watchdog), and sends are not waited (NCCL keeps a sent tensor alive
until its send is done).
"""
from __future__ import annotations

import pickle
from contextlib import nullcontext
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_dapple.execute.failure import FailureChannel
from lightning_dapple.execute.transfer.wires import HostReader, backend_for, waits_on_device
from lightning_dapple.plan.plan import Plan

RESULT_TAG = 7  # the schedule's transfers use tag 0; results never match them under gloo


class ResultChannel:
    """Share the global-batch loss and the last stage's objects with every rank of a plan."""

    def __init__(self, plan: Plan, rank: int, device: torch.device, failure: FailureChannel, by_tag: bool | None = None) -> None:
        last = plan.stages[-1]
        self.rank = rank
        gloo = backend_for(device) in (None, "gloo")
        self.device = torch.device("cpu") if gloo else device  # where the messages live (see above)
        self.failure = failure
        self.reader = HostReader(device, failure) if waits_on_device(device) else None
        self.source = last.devices[0]
        self.last_replicas = list(last.devices)
        self.is_last = rank in last.devices
        self.receivers = sorted({d for stage in plan.stages for d in stage.devices if d != self.source})
        self.single = plan.world_size == 1
        # whether early-posted receives are matched by tag (gloo) rather than by order (NCCL)
        self.by_tag = gloo if by_tag is None else by_tag
        self._posted: tuple[Any, torch.Tensor] | None = None
        self._sends: list[Any] = []
        self._keep: list[torch.Tensor] = []

    def post(self) -> None:
        """Post the receive of the next head now (step start), where tags keep it apart."""
        if self.single or not self.by_tag or self.rank == self.source or self._posted is not None:
            return
        self._posted = self._irecv(2, torch.float64, self.source)

    def share(self, loss_sum: torch.Tensor | None, obj: Any) -> tuple[torch.Tensor | None, list[Any]]:
        """The loss summed over the last stage's replicas and their objects in replica order.

        ``loss_sum`` is this rank's share (None on ranks outside the last stage, or when no
        loss is shared); ``obj`` is what this last-stage replica contributes (None: nothing).
        """
        self.flush()
        if self.single:
            return loss_sum, [obj]
        if self.rank == self.source:
            total, gathered = self._gather(loss_sum, obj)
            self._send_all(total, gathered)
            return total, gathered
        if self.is_last:
            self._send_own(loss_sum, obj)
        return self._receive(loss_sum is not None)

    def flush(self) -> None:
        """Wait for the source's sends of the previous hand-off (their buffers go then)."""
        sends, self._sends = self._sends, []
        self._wait_sends(sends, "results sent to the other ranks")
        self._keep = []

    def _wait_sends(self, works: Sequence[Any], what: str) -> None:
        if self.reader is None and works:  # under NCCL nothing waits for a send (see above)
            self.failure.wait_all(works, what)

    def _irecv(self, count: int, dtype: torch.dtype, peer: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of a message of ``count`` items from ``peer``: its work and buffer."""
        with self.reader.issuing() if self.reader is not None else nullcontext():
            buffer = torch.empty(count, dtype=dtype, device=self.device)
            return dist.irecv(buffer, peer, tag=RESULT_TAG), buffer

    def _read(self, work: Any, buffer: torch.Tensor, what: str) -> torch.Tensor:
        """``buffer`` on the host once ``work`` (its receive) is done."""
        if self.reader is not None:
            return self.reader.read([work], [buffer], what)[0]
        self.failure.wait(work, what)
        return buffer.cpu()

    # -- the source ----------------------------------------------------------------
    def _gather(self, loss_sum: torch.Tensor | None, obj: Any) -> tuple[torch.Tensor | None, list[Any]]:
        total = loss_sum
        gathered = [obj]
        for peer in self.last_replicas[1:]:
            head, peer_obj = self._complete(*self._irecv(2, torch.float64, peer), peer, f"results of last-stage rank {peer}")
            if total is not None:
                total = total + head[0]
            gathered.append(peer_obj)
        return total, gathered

    def _send_all(self, total: torch.Tensor | None, gathered: list[Any]) -> None:
        head, payload = self._encode(total, gathered if any(item is not None for item in gathered) else None)
        self._keep = [head] + ([payload] if payload is not None else [])
        for peer in self.receivers:
            self._sends.append(dist.isend(head, peer, tag=RESULT_TAG))
            if payload is not None:
                self._sends.append(dist.isend(payload, peer, tag=RESULT_TAG))

    # -- the other ranks -------------------------------------------------------------
    def _send_own(self, loss_sum: torch.Tensor | None, obj: Any) -> None:
        head, payload = self._encode(loss_sum, obj)
        works = [dist.isend(head, self.source, tag=RESULT_TAG)]
        if payload is not None:
            works.append(dist.isend(payload, self.source, tag=RESULT_TAG))
        self._wait_sends(works, f"results sent to last-stage rank {self.source}")

    def _receive(self, want_loss: bool) -> tuple[torch.Tensor | None, list[Any]]:
        self.post()
        if self._posted is not None:
            (work, head), self._posted = self._posted, None
        else:
            work, head = self._irecv(2, torch.float64, self.source)
        head, gathered = self._complete(work, head, self.source, f"results from rank {self.source}")
        if gathered is None:
            gathered = [None] * len(self.last_replicas)
        return (head[0] if want_loss else None), gathered

    # -- the message: a (loss, payload size) head, then the pickled object if any ------
    def _encode(self, loss: torch.Tensor | None, obj: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        payload = to_bytes(obj, self.device) if obj is not None else None
        head = torch.tensor(
            [float(loss) if loss is not None else 0.0, payload.numel() if payload is not None else 0],
            dtype=torch.float64,
            device=self.device,
        )
        return head, payload

    def _complete(self, work: Any, head: torch.Tensor, peer: int, what: str) -> tuple[torch.Tensor, Any]:
        """Wait for a head received into ``head``, then its payload: the head on the host,
        and the object (None when nothing was sent)."""
        head = self._read(work, head, what)
        size = int(head[1].item())
        if not size:
            return head, None
        return head, from_bytes(self._read(*self._irecv(size, torch.uint8, peer), what))


def to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return payload.to(device) if device.type != "cpu" else payload


def from_bytes(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())
