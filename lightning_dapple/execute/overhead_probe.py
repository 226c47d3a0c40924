"""Measure the executor's own time per action on this machine (``ActionOverhead``).

The layer profiler (PipeDream 3.2) times each layer's forward and backward alone; the
executor spends more per action than that (``profile/action_overhead.py``). This probe runs
the executor's real code on a layer that does almost nothing and subtracts what the profiler
measures for the same layer, so what is left is exactly what the model was missing:

* F, B, I, W: the actions of a middle stage (``execute/stage.py``: state lookup, reseeding,
  stash and weight-gradient bookkeeping) on one small ``nn.Linear``, B on a stage with a
  full backward, I and W on one that defers weight gradients (ooo-backprop sec. 3), less
  ``profile_layers``' forward, backward, input-gradient and weight-gradient times of that
  layer;
* send, recv: one activation transfer through the ``Transport`` (split-concat rows, message
  packing and unpacking, DAPPLE 5.2.2) over a ``LoopbackWire``, which hands every message
  to the next receive from the same peer in this process: the transport's own work with the
  wire taken out (the wire's time is the cluster's ``p2p_ms``).

Each is the median of ``repeats`` timed calls after ``warmup`` untimed ones, and a compute
kind's difference is floored at 0 (B, I and W do little beyond the profiler's own autograd
call, so noise can put the executor's median below it); one call of
``measure_action_overhead`` takes well under a second on a CPU and runs in one process, so
rank 0 measures it beside the layer profile, before any stage exists.
"""
from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_dapple.execute.transfer.keys import transfer_key
from lightning_dapple.execute.stage import Stage
from lightning_dapple.execute.transfer.transport import Peer, Transport
from lightning_dapple.execute.transfer.wires import Incoming, Wire, _with_flags
from lightning_dapple.profile.action_overhead import ActionOverhead
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.profiler import profile_layers, timed_ms
from lightning_dapple.schedule.actions import Kind

__all__ = ["LoopbackWire", "measure_action_overhead", "with_action_overhead"]

_WIDTH = 16
_ROWS = 4
_PEER = 1  # the loopback's one peer: this process plays both ends


class _Done:
    """A Work that is complete when issued."""

    def wait(self, *args: Any) -> bool:
        return True


class LoopbackWire(Wire):
    """gloo's message policy without the network: a message sent to a peer (with a tag) is
    what the next receive from that peer (with that tag) gets, copied into the receive's
    buffer (gloo accepts a message shorter than its receive, and so does this)."""

    name = "loopback"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, failure=None)  # type: ignore[arg-type]  # nothing here ever waits
        self._queues: dict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)

    def send_one(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> tuple[Any, Any]:
        self._queues[(peer, tag)].append(tensor)
        return _Done(), tensor

    def wait_sends(self, works: Sequence[Any], what: str) -> None:
        """Loopback sends are complete when issued."""

    def post(self, specs: Sequence[tuple[int, Any, bool]], direction: str, control: bool = False, tag: int = 0) -> list[Incoming]:
        out = []
        for peer, spec, flagged in specs:
            buffer = spec.make(self.device, self.zero_flags)
            message = self._queues[(peer, tag)].popleft().reshape(-1).view(torch.uint8)
            buffer.reshape(-1).view(torch.uint8)[: message.numel()].copy_(message)
            out.append(Incoming(peer, _Done(), buffer, spec.shape, spec.dtype, flagged))
        return out

    def wait(self, incoming: Sequence[Incoming], what: str) -> list[tuple[torch.Tensor, int]]:
        return _with_flags(incoming)


def _median_ms(device: torch.device, fn: Callable[[], Any], repeats: int, warmup: int, before: Callable[[], Any]) -> float:
    """Median of ``timed_ms(fn)`` over ``repeats`` calls after ``warmup`` (``before`` runs
    untimed ahead of each call)."""
    times = []
    for index in range(warmup + repeats):
        before()
        elapsed, _ = timed_ms(device, fn)
        if index >= warmup:
            times.append(elapsed)
    return statistics.median(times)


class _StageProbe:
    """One micro-batch at a time through a middle stage of one layer (``split``: deferring
    its weight gradients to one W)."""

    def __init__(self, layer: nn.Module, device: torch.device, split: bool) -> None:
        self.stage = Stage([layer], device, index=1, replica=0, num_stages=3, split=split, w_count={0: 1} if split else None)
        self.device = device
        self.batch = torch.zeros(_ROWS, 1, device=device)
        self.grad = torch.randn(_ROWS, _WIDTH, device=device)

    def begin(self) -> None:
        """A fresh step with micro-batch 0's input received."""
        self.stage.end_step()
        self.stage.begin_step(self.batch, _ROWS, [(0, _ROWS)], None, 1.0, (0, 0))  # type: ignore[arg-type]  # no callbacks: a middle stage
        self.stage.receive(0, torch.randn(_ROWS, _WIDTH, device=self.device, requires_grad=True))

    def forwarded(self) -> None:
        """``begin``, micro-batch 0's forward and its output gradient received."""
        self.begin()
        self.stage.forward(0)
        like = self.stage.gradient_like(0)
        assert like is not None
        self.stage.receive_gradient(0, like, [self.grad])

    def backward(self) -> None:
        self.stage.backward_input(0)
        self.stage.input_gradients(0)


def _compute_overheads(device: torch.device, repeats: int, warmup: int) -> dict[str, float]:
    """F, B, I, W: the Stage's action time less the profiler's time of the same layer."""
    torch.manual_seed(0)
    layer = nn.Linear(_WIDTH, _WIDTH).to(device)
    sample = torch.randn(_ROWS, _WIDTH, device=device)
    bare = profile_layers([layer], sample, device=device, repeats=repeats, warmup=warmup).layers[0]
    full = _StageProbe(layer, device, split=False)
    split = _StageProbe(layer, device, split=True)
    forward = _median_ms(device, lambda: full.stage.forward(0), repeats, warmup, before=full.begin)
    backward = _median_ms(device, full.backward, repeats, warmup, before=full.forwarded)
    backward_input = _median_ms(device, split.backward, repeats, warmup, before=split.forwarded)

    def deferred() -> None:
        split.forwarded()
        split.backward()

    backward_weight = _median_ms(device, lambda: split.stage.backward_weight(0), repeats, warmup, before=deferred)
    full.stage.end_step()
    split.stage.end_step()
    return {
        "forward": max(forward - bare.forward_ms, 0.0),
        "backward": max(backward - bare.backward_ms, 0.0),
        "backward_input": max(backward_input - bare.input_grad_ms, 0.0),
        "backward_weight": max(backward_weight - bare.weight_grad_ms, 0.0),
    }


def _transfer_overheads(device: torch.device, repeats: int, warmup: int) -> dict[str, float]:
    """send, recv: one activation of ``_ROWS`` rows through the Transport over a loopback."""
    transport = Transport(None, device, wire=LoopbackWire(device))  # type: ignore[arg-type]  # the loopback never waits
    peers = [Peer(_PEER, (0, _ROWS))]
    key = transfer_key(Kind.SEND_ACT, 0, 0)
    output = torch.randn(_ROWS, _WIDTH, device=device, requires_grad=True)

    def send() -> None:
        transport.send_activation(output, (0, _ROWS), peers, key)
        transport.flush()

    def recv() -> None:
        transport.recv_activation((0, _ROWS), peers, key)

    send()
    recv()  # the layout is known from here on: the steady state
    send_times, recv_times = [], []
    for index in range(warmup + repeats):
        send_ms, recv_ms = timed_ms(device, send)[0], timed_ms(device, recv)[0]
        if index >= warmup:
            send_times.append(send_ms)
            recv_times.append(recv_ms)
    return {"send": statistics.median(send_times), "recv": statistics.median(recv_times)}


def measure_action_overhead(device: str | torch.device = "cpu", repeats: int = 30, warmup: int = 5) -> ActionOverhead:
    """The executor's own milliseconds per action kind on ``device`` (module docstring).

    Runs in this process only, leaves the global RNG state as it found it, and needs no
    process group."""
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        values = {**_compute_overheads(dev, repeats, warmup), **_transfer_overheads(dev, repeats, warmup)}
    return ActionOverhead(**values)


def with_action_overhead(profile: ModelProfile, device: str | torch.device = "cpu") -> ModelProfile:
    """``profile`` with the executor's overhead on ``device`` measured now and recorded."""
    return replace(profile, action_overhead_ms=measure_action_overhead(device))
