"""Hand-made ``StageCost`` for simulator and schedule tests: times in ms, sizes in bytes."""
from __future__ import annotations

from lightning_dapple.plan.costs import StageCost


def cost(
    f: float, b: float, send: float = 0.0, ar: float = 0.0, stash: float = 1.0, bi: float | None = None, bw: float = 0.0
) -> StageCost:
    """A stage with forward ``f`` and backward ``b`` (input part ``bi``, weight part ``bw``),
    whose output takes ``send`` to the next stage and whose AllReduce takes ``ar``."""
    return StageCost(
        forward_ms=f,
        backward_ms=b,
        backward_input_ms=b if bi is None else bi,
        backward_weight_ms=bw,
        param_bytes=0.0,
        stash_bytes=stash,
        output_bytes=0.0,
        send_ms=send,
        allreduce_ms=ar,
        slice_size=1.0,
    )
