"""When each compute action of a step ran on this rank: the measured timeline.

The runner marks the start and the end of every F, B (recomputation included) and W. What
a mark means depends on where the work runs, so the clock is chosen once per device:

* ``HostSpans`` (CPU): ``time.perf_counter`` around the call; the work is done when the
  call returns.
* ``CudaSpans`` (CUDA): a call only queues kernels, so host clocks would show launch times
  (compute looking instant, the waiting landing in the receives). Each mark records a CUDA
  event on the current stream instead; the spans are read once, when the step's timeline is
  first asked for: one wait for the last event, then event-to-event times (which need no
  further waiting). Nothing in the step itself waits for the device.

Both give ``(start, end, kind, micro-batch, stage)`` in ``time.perf_counter`` seconds (the
stage tells a rank's chunks apart under interleaving and ZB-V), so the ranks
of one host share a clock (``app/timelines.py`` aligns hosts). For CUDA the step's first
event is placed on that clock by the host times at which the events were recorded: an
event completes no earlier than it was queued, so ``queued_i - offset_i`` is a lower
bound of the first event's time for every mark ``i``, and the largest of them is exact
whenever the device caught up with the host at some mark of the step (it waited for a
transfer, or the host ran behind).
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

__all__ = ["CudaSpans", "DeviceSpan", "HostSpans", "Span", "on_host_clock", "span_clock"]

Span = tuple[float, float, str, int, int]  # start, end, kind, micro-batch, stage


class HostSpans:
    """``perf_counter`` around each action (the work is done when the call returns)."""

    def __init__(self) -> None:
        self._spans: list[Span] = []

    def begin(self) -> float:
        return time.perf_counter()

    def end(self, begun: float, kind: str, microbatch: int, stage: int) -> None:
        self._spans.append((begun, time.perf_counter(), kind, microbatch, stage))

    def read(self) -> list[Span]:
        return self._spans


class _Mark(NamedTuple):
    event: Any  # torch.cuda.Event
    queued: float  # perf_counter just before the event was recorded


class CudaSpans:
    """CUDA events around each action, read once (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[tuple[_Mark, _Mark, str, int, int]] = []
        self._read: list[Span] | None = None

    def _mark(self) -> _Mark:
        queued = time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return _Mark(event, queued)

    def begin(self) -> _Mark:
        return self._mark()

    def end(self, begun: _Mark, kind: str, microbatch: int, stage: int) -> None:
        self._marks.append((begun, self._mark(), kind, microbatch, stage))

    def read(self) -> list[Span]:
        if self._read is None:
            self._read = self._resolve()
        return self._read

    def _resolve(self) -> list[Span]:
        if not self._marks:
            return []
        origin = self._marks[0][0].event
        self._marks[-1][1].event.synchronize()  # the last mark: every earlier one is complete too
        return on_host_clock(
            [
                DeviceSpan(origin.elapsed_time(start.event) / 1e3, origin.elapsed_time(end.event) / 1e3, start.queued, end.queued, kind, mb, stage)
                for start, end, kind, mb, stage in self._marks
            ]
        )


class DeviceSpan(NamedTuple):
    """One action as the device ran it: seconds after the step's first event, and the host
    times at which its two events were queued."""

    start: float
    end: float
    queued_start: float
    queued_end: float
    kind: str
    microbatch: int
    stage: int


def on_host_clock(spans: list[DeviceSpan]) -> list[Span]:
    """``spans`` on the ``perf_counter`` clock: the step's first event is placed at the
    largest lower bound its marks give (an event completes no earlier than it was queued)."""
    anchor = max(max(s.queued_start - s.start, s.queued_end - s.end) for s in spans)
    return [(anchor + s.start, anchor + s.end, s.kind, s.microbatch, s.stage) for s in spans]


def span_clock(device: torch.device) -> HostSpans | CudaSpans:
    """A fresh clock for one step's spans on ``device``."""
    return CudaSpans(device) if device.type == "cuda" else HostSpans()
