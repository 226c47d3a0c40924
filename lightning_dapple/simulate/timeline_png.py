"""Draw a simulated step as a picture in the style of DAPPLE Fig. 3 and 4.

One row per device (replicas of a stage show the same row), time in ms along x. Forward
blocks are blue and backward blocks green as in the paper's figures; deferred weight
gradients (W, out-of-order backprop) are orange and AllReduce grey. Each block carries its
micro-batch id when there is room for it; the white gaps are the bubbles.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from lightning_dapple.simulate.engine import SimulationResult

__all__ = ["COLOURS", "draw_timeline"]

COLOURS = {"F": "#4a7fd4", "B": "#4caf50", "W": "#f39c34", "AR": "#9e9e9e"}
LABELS = {"F": "forward", "B": "backward", "W": "weight grad", "AR": "AllReduce"}


def draw_timeline(result: "SimulationResult", path: str | Path, title: str | None = None) -> Path:
    """Write ``result``'s device timelines as a PNG to ``path`` and return the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    devices = list(result.timelines)
    latency = max(result.latency_ms, 1e-9)
    width = min(max(8.0, 0.25 * sum(len(v) for v in result.timelines.values()) / max(len(devices), 1)), 30.0)
    height = max(1.6, 0.45 * len(devices) + 1.2)
    stage_of = {device: stage.stage for stage in result.stages for device in stage.devices}

    fig, ax = plt.subplots(figsize=(width, height))
    try:
        fig_width_px = fig.get_figwidth() * fig.dpi
        used = set()
        for row, device in enumerate(devices):
            blocks: dict[str, list[tuple[float, float]]] = {}
            for span in result.timelines[device]:
                length = span.end_ms - span.start_ms
                if length <= 0:
                    continue
                blocks.setdefault(span.kind, []).append((span.start_ms, length))
                label = "AR" if span.kind == "AR" else str(span.microbatch)
                # only label blocks wide enough to hold the text (~7 px per character)
                if length / latency * fig_width_px * 0.8 >= 7 * len(label) + 2:
                    ax.text(
                        span.start_ms + length / 2,
                        row,
                        label,
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="black" if span.kind == "W" else "white",
                    )
            for kind, ranges in blocks.items():
                used.add(kind)
                ax.broken_barh(
                    ranges,
                    (row - 0.4, 0.8),
                    facecolors=COLOURS.get(kind, "#cccccc"),
                    edgecolors="white",
                    linewidth=0.5,
                )
        ax.set_yticks(range(len(devices)))
        ax.set_yticklabels([f"dev {d} (s{stage_of.get(d, '?')})" for d in devices])
        ax.invert_yaxis()
        ax.set_xlim(0, latency)
        ax.set_xlabel("time (ms)")
        ax.set_title(
            title
            or f"{result.schedule}: M={result.micro_batches}, latency {result.latency_ms:.2f} ms, "
            f"bubble {100 * result.bubble_fraction:.1f}%"
        )
        handles = [Patch(color=COLOURS[k], label=LABELS[k]) for k in COLOURS if k in used]
        if handles:
            ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(devices) < 4 else -0.12), ncol=len(handles), fontsize=8, frameon=False)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
