"""Timeline pictures: one drawing function for the simulated and the measured step, and a
layout in which the title is whole and the legend stays clear of the axis labels.

The geometry is read off the figure right after ``savefig`` has drawn it with the Agg
renderer (``Figure.savefig`` is wrapped), so the boxes are the ones in the PNG.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_dapple.app.timelines import MeasuredSpan, MeasuredTimeline, draw_measured_timeline
from lightning_dapple.schedule import build_schedule
from lightning_dapple.simulate import Span, simulate
from lightning_dapple.simulate import timeline_png
from lightning_dapple.simulate.timeline_png import TimelineRow, draw_rows, draw_timeline
from stage_costs import cost

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LONG_TITLE = (
    "simulated: dapple, M=8, step 3493.73 ms, bubble 21.3% (A100-SXM4-80GB profile measured at "
    "micro-batch 6, cluster /some/rather/long/path/to/a/cluster/description.yaml) and then some "
    "more words so that the title cannot fit on one line of even a wide figure"
)


def simulated(stages: int, micro_batches: int = 4):
    return simulate(build_schedule("dapple", stages, micro_batches), [cost(1, 2, ar=0.5) for _ in range(stages)])


def measured(ranks: int, micro_batches: int = 4) -> MeasuredTimeline:
    spans: dict[int, list[Any]] = {}
    for rank in range(ranks):
        t = 0.3 * rank
        items = []
        for mb in range(micro_batches):
            items.append(MeasuredSpan(t, t + 1.0, "F", mb))
            items.append(MeasuredSpan(t + 1.1, t + 3.0, "B", mb))
            t += 3.2
        for mb in range(micro_batches):
            items.append(MeasuredSpan(t, t + 0.4, "W", mb))
            t += 0.4
        spans[rank] = items
    return MeasuredTimeline("dapple", micro_batches, {r: r // 2 for r in range(ranks)}, spans)


# -- geometry of what was saved ---------------------------------------------------------


def _flat(text: str) -> str:
    return " ".join(text.split())


def _tick_boxes(axis: Any, renderer: Any) -> list[Any]:
    """Boxes of the tick labels that are drawn (ticks inside the view limits)."""
    low, high = sorted(axis.get_view_interval())
    span = high - low
    return [
        tick.label1.get_window_extent(renderer)
        for tick in axis.get_major_ticks()
        if low - 1e-9 * span <= tick.get_loc() <= high + 1e-9 * span and tick.label1.get_visible() and tick.label1.get_text()
    ]


def _geometry(fig: Any) -> dict[str, Any]:
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    axes = fig.axes[0]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return {
        "figure": fig.bbox,
        "texts": {id(t): (t.get_text(), t.get_window_extent(renderer)) for t in texts},
        "axes": axes.bbox,
        "xlabel": axes.xaxis.label.get_window_extent(renderer),
        "xticks": _tick_boxes(axes.xaxis, renderer),
        "yticks": _tick_boxes(axes.yaxis, renderer),
        "legends": [legend.get_window_extent(renderer) for legend in legends],
    }


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    from matplotlib.figure import Figure

    records: list[dict[str, Any]] = []
    original = Figure.savefig

    def savefig(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        records.append(_geometry(self))
        return out

    monkeypatch.setattr(Figure, "savefig", savefig)
    return records


def _inside(inner: Any, outer: Any, slack: float = 0.5) -> bool:
    return (
        inner.x0 >= outer.x0 - slack
        and inner.y0 >= outer.y0 - slack
        and inner.x1 <= outer.x1 + slack
        and inner.y1 <= outer.y1 + slack
    )


def _overlap(a: Any, b: Any) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _title_box(geometry: dict[str, Any], title: str) -> Any:
    boxes = [box for text, box in geometry["texts"].values() if _flat(text) == _flat(title)]
    assert len(boxes) == 1, f"title {title!r} not drawn once: {[t for t, _ in geometry['texts'].values()]}"
    return boxes[0]


def _check_layout(geometry: dict[str, Any], title: str) -> None:
    figure = geometry["figure"]
    title_box = _title_box(geometry, title)
    assert _inside(title_box, figure), f"title clipped: {title_box} not inside {figure}"
    assert not _overlap(title_box, geometry["axes"]), "title runs into the plot"
    labels = [geometry["xlabel"], *geometry["xticks"], *geometry["yticks"]]
    for box in labels:
        assert _inside(box, figure), f"axis label clipped: {box} not inside {figure}"
        assert not _overlap(title_box, box)
    assert geometry["legends"], "no legend drawn"
    for legend in geometry["legends"]:
        assert _inside(legend, figure), f"legend clipped: {legend} not inside {figure}"
        assert not _overlap(legend, geometry["xlabel"]), f"legend {legend} overlaps the x label {geometry['xlabel']}"
        assert not _overlap(legend, title_box), "legend overlaps the title"
        assert not _overlap(legend, geometry["axes"]), "legend covers the plot"
        for box in labels:
            assert not _overlap(legend, box), f"legend {legend} overlaps a tick label {box}"


# -- one drawing function ---------------------------------------------------------------


@pytest.fixture
def draw_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[TimelineRow], str]]:
    calls: list[tuple[list[TimelineRow], str]] = []

    def spy(rows: Any, path: Any, title: str, span_ms: float | None = None) -> Path:
        calls.append((list(rows), title))
        return draw_rows(rows, path, title, span_ms=span_ms)

    monkeypatch.setattr(timeline_png, "draw_rows", spy)
    return calls


def test_simulated_timeline_is_drawn_by_draw_rows(tmp_path: Path, draw_calls: list, saved: list) -> None:
    result = simulated(3)
    path = draw_timeline(result, tmp_path / "sim.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert len(draw_calls) == 1 and len(saved) == 1
    rows, title = draw_calls[0]
    assert [row.label for row in rows] == ["dev 0 (s0)", "dev 1 (s1)", "dev 2 (s2)"]
    assert [list(row.spans) for row in rows] == [list(result.timelines[d]) for d in range(3)]
    assert title.startswith("dapple: M=4, latency")


def test_measured_timeline_is_drawn_by_draw_rows(tmp_path: Path, draw_calls: list, saved: list) -> None:
    timeline = measured(4)
    path = draw_measured_timeline(timeline, tmp_path / "nested" / "measured.png")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert len(draw_calls) == 1 and len(saved) == 1
    rows, title = draw_calls[0]
    assert [row.label for row in rows] == ["rank 0 (s0)", "rank 1 (s0)", "rank 2 (s1)", "rank 3 (s1)"]
    assert all(isinstance(span, Span) for row in rows for span in row.spans)
    assert title.startswith("measured (last step): dapple, M=4")


def test_measured_spans_are_the_simulator_spans() -> None:
    timeline = MeasuredTimeline.from_gathered(
        [{"spans": [(10.0, 10.002, "F", 0), (10.003, 10.007, "B", 0)], "reference": 0.0, "host": "h"}],
        type("Plan", (), {"schedule": "gpipe", "micro_batches": 1, "stages_of_rank": staticmethod(lambda r: (0,))})(),
    )
    first, second = timeline.spans[0]
    assert isinstance(first, Span) and first.kind == "F" and first.microbatch == 0
    assert first.start_ms == 0.0 and second.end_ms == pytest.approx(7.0)
    assert timeline.to_dict()["ranks"]["0"]["spans"][1][2] == "B"


# -- layout -------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 5])
@pytest.mark.parametrize("long_title", [False, True])
def test_simulated_layout(tmp_path: Path, saved: list, stages: int, long_title: bool) -> None:
    result = simulated(stages, micro_batches=6)
    title = LONG_TITLE if long_title else None
    draw_timeline(result, tmp_path / "t.png", title=title)
    expected = title or f"dapple: M=6, latency {result.latency_ms:.2f} ms, bubble {100 * result.bubble_fraction:.1f}%"
    _check_layout(saved[-1], expected)


@pytest.mark.parametrize("ranks", [1, 3])
def test_measured_layout(tmp_path: Path, saved: list, ranks: int) -> None:
    timeline = measured(ranks)
    draw_measured_timeline(timeline, tmp_path / "m.png")
    expected = (
        f"measured (last step): dapple, M=4, {timeline.span_ms:.2f} ms from first to last compute, "
        f"busy {100 * timeline.busy_fraction():.1f}%"
    )
    _check_layout(saved[-1], expected)
    draw_measured_timeline(timeline, tmp_path / "m2.png", title=LONG_TITLE)
    _check_layout(saved[-1], LONG_TITLE)


def test_long_title_is_wrapped_not_shrunk(tmp_path: Path, saved: list) -> None:
    draw_rows([TimelineRow("dev 0", [Span(0.0, 1.0, "F", 0)])], tmp_path / "w.png", LONG_TITLE)
    texts = [text for text, _ in saved[-1]["texts"].values() if _flat(text) == _flat(LONG_TITLE)]
    assert texts and "\n" in texts[0]


def test_unknown_kind_and_empty_rows(tmp_path: Path, saved: list) -> None:
    rows = [
        TimelineRow("a", [Span(0.0, 1.0, "F", 0), Span(1.0, 2.0, "R", None), Span(2.0, 2.0, "B", 0)]),
        TimelineRow("b", []),
    ]
    path = draw_rows(rows, tmp_path / "u.png", "unknown kinds")
    assert path.read_bytes()[:8] == PNG_MAGIC
    _check_layout(saved[-1], "unknown kinds")
