"""The measured timeline of a pipeline step: what each rank's executor really did, drawn
by the simulator's drawing function (``lightning_dapple.simulate.timeline_png.draw_rows``).

Each rank's ``StageRunner`` records ``(start, end, kind, micro-batch, stage)`` in
``time.perf_counter`` seconds for every F, B and W of the last step. A rank that holds
several stages (interleaved 1F1B, ZB-V) keeps each span's stage, labelled
``stage:micro-batch`` as in the simulated picture. On one host these
clocks are the same monotonic clock; across hosts each rank's times are shifted by the
difference of ``perf_counter()`` readings taken right after a common barrier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from lightning_dapple.simulate.engine import Span
from lightning_dapple.simulate import timeline_png
from lightning_dapple.simulate.timeline_png import TimelineRow

__all__ = ["MeasuredSpan", "MeasuredTimeline", "draw_measured_timeline"]

#: A measured block is the simulator's ``Span`` (start_ms, end_ms, kind, microbatch), so
#: both pictures go through the same drawing function.
MeasuredSpan = Span


@dataclass
class MeasuredTimeline:
    """Spans per global rank in ms from the first span of the step."""

    schedule: str
    micro_batches: int
    stage_of_rank: dict[int, int | str]  # a stage, or a rank's chunks joined by ',' ('0,2'), as the simulated timeline names them
    spans: dict[int, list[MeasuredSpan]] = field(default_factory=dict)
    aligned_hosts: bool = False

    @property
    def span_ms(self) -> float:
        ends = [s.end_ms for spans in self.spans.values() for s in spans]
        return max(ends) if ends else 0.0

    def busy_fraction(self) -> float:
        """Share of rank-time spent in F/B/W between the first start and the last end."""
        total = self.span_ms * max(len(self.spans), 1)
        busy = sum(s.end_ms - s.start_ms for spans in self.spans.values() for s in spans)
        return busy / total if total > 0 else 0.0

    @classmethod
    def from_gathered(cls, gathered: Sequence[dict[str, Any]], plan: Any) -> "MeasuredTimeline":
        """Build from ``[{"spans": [(start, end, kind, mb, stage), ...], "reference": t, "host": h}]`` by rank."""
        hosts = {item.get("host") for item in gathered}
        shift = [0.0] * len(gathered)
        if len(hosts) > 1:  # different machines: align on the barrier readings
            base = gathered[0]["reference"]
            shift = [base - item["reference"] for item in gathered]
        starts = [float(s[0]) + shift[rank] for rank, item in enumerate(gathered) for s in item["spans"]]
        origin = min(starts) if starts else 0.0
        spans: dict[int, list[MeasuredSpan]] = {}
        for rank, item in enumerate(gathered):
            chunked = len(plan.stages_of_rank(rank)) > 1  # the stage tells the rank's chunks apart
            spans[rank] = [
                MeasuredSpan(
                    1e3 * (float(s[0]) + shift[rank] - origin),
                    1e3 * (float(s[1]) + shift[rank] - origin),
                    str(s[2]),
                    None if s[3] is None else int(s[3]),
                    int(s[4]) if chunked and len(s) > 4 else None,
                )
                for s in item["spans"]
            ]
        stage_of = {rank: _stages_label(plan.stages_of_rank(rank)) for rank in range(len(gathered))}
        return cls(plan.schedule, plan.micro_batches, stage_of, spans, aligned_hosts=len(hosts) > 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "span_ms": self.span_ms,
            "busy_fraction": self.busy_fraction(),
            "aligned_hosts": self.aligned_hosts,
            "ranks": {
                str(rank): {
                    "stage": self.stage_of_rank.get(rank),
                    "spans": [[s.start_ms, s.end_ms, s.kind, s.microbatch, *(() if s.stage is None else (s.stage,))] for s in spans],
                }
                for rank, spans in self.spans.items()
            },
        }


def _stages_label(stages: Sequence[int]) -> int | str:
    return stages[0] if len(stages) == 1 else ",".join(str(stage) for stage in stages)


def draw_measured_timeline(timeline: MeasuredTimeline, path: str | Path, title: str | None = None) -> Path:
    """Write the measured spans as a PNG: one row per rank, F blue, B green, W orange.

    Drawn by ``lightning_dapple.simulate.timeline_png.draw_rows``, like the simulated step.
    """
    rows = [
        TimelineRow(f"rank {rank} (s{timeline.stage_of_rank.get(rank, '?')})", timeline.spans[rank])
        for rank in sorted(timeline.spans)
    ]
    default = (
        f"measured (last step): {timeline.schedule}, M={timeline.micro_batches}, "
        f"{timeline.span_ms:.2f} ms from first to last compute, busy {100 * timeline.busy_fraction():.1f}%"
    )
    return timeline_png.draw_rows(rows, path, title or default, span_ms=timeline.span_ms)
