"""Draw a step's timeline as a picture in the style of DAPPLE Fig. 3 and 4.

One row per device (replicas of a stage show the same row), time in ms along x. Forward
blocks are blue and backward blocks green as in the paper's figures; deferred weight
gradients (W, out-of-order backprop) are orange, AllReduce grey and the AllReduce of tied
parameters over the stages sharing them ("TAR") purple, the optimizer step ("OPT") brown.
Each block carries its
micro-batch id when there is room for it (``stage:micro-batch`` on a device that runs
several stages, the chunks of interleaved and V schedules); the white gaps are the bubbles.

``draw_rows`` is the one drawing function: ``draw_timeline`` feeds it a simulated step and
``lightning_dapple.app.timelines.draw_measured_timeline`` the spans a real step recorded.
The title sits above everything and is wrapped to the figure's width, the legend sits to
the right of the axes, and ``constrained_layout`` keeps tick labels, axis label, title and
legend inside the figure and apart.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lightning_dapple.simulate.engine import SimulationResult

__all__ = ["COLOURS", "LABELS", "TimelineRow", "draw_rows", "draw_timeline"]

COLOURS = {"F": "#4a7fd4", "B": "#4caf50", "W": "#f39c34", "AR": "#9e9e9e", "TAR": "#8e5ea2", "OPT": "#8d6e63"}
LABELS = {"F": "forward", "B": "backward", "W": "weight grad", "AR": "AllReduce", "TAR": "tied AllReduce", "OPT": "optimizer"}
OTHER_COLOUR = "#cccccc"
TITLE_SIZE = 12
DPI = 100


class SpanLike(Protocol):
    """What a block needs: ``lightning_dapple.simulate.engine.Span`` has these fields."""

    start_ms: float
    end_ms: float
    kind: str
    microbatch: int | None


@dataclass(frozen=True)
class TimelineRow:
    """One row of the picture: its y tick label and its blocks in ms."""

    label: str
    spans: Sequence[SpanLike]


def _block_label(span: SpanLike) -> str:
    """The micro-batch id, as ``stage:micro-batch`` where a device runs several stages."""
    if span.kind in ("AR", "TAR", "OPT"):
        return span.kind
    if span.microbatch is None:
        return ""
    stage = getattr(span, "stage", None)
    return str(span.microbatch) if stage is None else f"{stage}:{span.microbatch}"


def _wrap_title(fig: Any, text: str, size: float) -> str:
    """``text`` with line breaks so that each line fits the figure's width (measured)."""
    renderer = fig.canvas.get_renderer()
    room = fig.get_figwidth() * fig.dpi - 24  # a little margin either side
    probe = fig.text(0, 0, "", fontsize=size)
    try:
        lines = text.splitlines() or [""]
        chars = max(8, max(len(line) for line in lines))
        while True:
            wrapped = "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) or line for line in lines)
            probe.set_text(wrapped)
            if probe.get_window_extent(renderer).width <= room or chars <= 8:
                return wrapped
            chars = max(8, int(chars * 0.9))
    finally:
        probe.remove()


def draw_rows(rows: Sequence[TimelineRow], path: str | Path, title: str, span_ms: float | None = None) -> Path:
    """Write ``rows`` (top to bottom) as a PNG to ``path`` and return the path.

    ``span_ms`` is the length of the x axis; by default the last end of any span.
    """
    # matplotlib loads only when a picture is drawn; an Agg canvas of our own leaves
    # pyplot's global figure list and backend alone
    import matplotlib.backends.backend_agg, matplotlib.figure, matplotlib.patches  # noqa: E401

    path = Path(path)
    ends = [s.end_ms for row in rows for s in row.spans]
    total = max(span_ms if span_ms is not None else max(ends, default=0.0), 1e-9)
    count = sum(len(row.spans) for row in rows)
    width = min(max(8.0, 0.25 * count / max(len(rows), 1)), 30.0)
    height = max(1.6, 0.45 * len(rows) + 1.2)

    fig = matplotlib.figure.Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    matplotlib.backends.backend_agg.FigureCanvasAgg(fig)
    ax = fig.subplots()
    title = _wrap_title(fig, title, TITLE_SIZE)
    extra_lines = title.count("\n")
    if extra_lines:
        fig.set_figheight(height + 0.22 * extra_lines)
    axes_px = fig.get_figwidth() * fig.dpi * 0.75  # room left of the legend, right of the tick labels
    used: list[str] = []
    for index, row in enumerate(rows):
        blocks: dict[str, list[tuple[float, float]]] = {}
        for span in row.spans:
            length = span.end_ms - span.start_ms
            if length <= 0:
                continue
            blocks.setdefault(span.kind, []).append((span.start_ms, length))
            label = _block_label(span)
            # only label blocks wide enough to hold the text (~7 px per character)
            if label and length / total * axes_px >= 7 * len(label) + 2:
                ax.text(
                    span.start_ms + length / 2,
                    index,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black" if span.kind == "W" else "white",
                )
        for kind, ranges in blocks.items():
            if kind not in used:
                used.append(kind)
            ax.broken_barh(
                ranges,
                (index - 0.4, 0.8),
                facecolors=COLOURS.get(kind, OTHER_COLOUR),
                edgecolors="white",
                linewidth=0.5,
            )
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row.label for row in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_xlim(0, total)
    ax.set_xlabel("time (ms)")
    fig.suptitle(title, fontsize=TITLE_SIZE)
    kinds = [k for k in COLOURS if k in used] + [k for k in used if k not in COLOURS]
    handles = [matplotlib.patches.Patch(color=COLOURS.get(k, OTHER_COLOUR), label=LABELS.get(k, k)) for k in kinds]
    if handles:
        fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


def draw_timeline(result: "SimulationResult", path: str | Path, title: str | None = None) -> Path:
    """Write ``result``'s device timelines as a PNG to ``path`` and return the path."""
    stages_of: dict[int, list[int]] = {}
    for stage in result.stages:
        for device in stage.devices:
            stages_of.setdefault(device, []).append(stage.stage)
    rows = [TimelineRow(f"dev {d} (s{','.join(map(str, stages_of.get(d, ['?'])))})", spans) for d, spans in result.timelines.items()]
    default = (
        f"{result.schedule}: M={result.micro_batches}, latency {result.latency_ms:.2f} ms, "
        f"bubble {100 * result.bubble_fraction:.1f}%"
    )
    return draw_rows(rows, path, title or default, span_ms=result.latency_ms)
