"""What the executor measured on one rank during its last step (one runner or several chunks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from lightning_dapple.execute.spans import CudaSpans, HostSpans, Span

__all__ = ["StageStats"]


@dataclass
class StageStats:
    """What the executor measured on this rank during the last step.

    ``timeline`` holds (start, end, kind, micro-batch) of every F, B (recomputation
    included) and W, in ``time.perf_counter`` seconds: host times on a CPU, CUDA event
    times on a GPU, read when first asked for (``execute/spans.py``). ``step_s`` is the
    host's wall time of the whole step, from its start to the loss known on every rank:
    what the simulator prices (DAPPLE 4: the pipeline's latency with its gradient sync),
    plus the user's step around the layers and the sharing of the loss and logs.
    """

    peak_in_flight: int = 0
    peak_stash_bytes: int = 0
    # per micro-batch (per (stage, micro-batch) on a rank holding several stages): what its F stashed
    stash_bytes: dict[Hashable, int] = field(default_factory=dict)
    spans: HostSpans | CudaSpans = field(default_factory=HostSpans)
    recomputed: int = 0
    step_s: float = 0.0

    @property
    def timeline(self) -> list[Span]:
        return self.spans.read()
