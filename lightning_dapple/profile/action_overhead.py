"""The executor's own time per action, beside the layers' compute: ``action_overhead_ms``.

A layer profile (PipeDream 3.2, DAPPLE 4.1) times the layers alone. The executor does more
per action: it looks up the micro-batch's state, reseeds the RNG, records timeline spans,
files stash sizes, and for a transfer slices rows, packs messages and unpacks them (DAPPLE
5.2.2's split-concat, ``execute/transfer/transport.py``). On small stages that fixed cost is a large
share of a step: deferred weight gradients (ooo-backprop sec. 3) add one W action per
micro-batch, and when the simulator ignores what each W costs the executor it expects a
saving that the run does not get.

``ActionOverhead`` holds that fixed cost, in milliseconds, per action kind: ``F``, ``B``
(full backward), ``I`` (input-gradient backward), ``W`` (deferred weight gradients),
``send`` and ``recv`` (the transport's own work per transfer, without the time on the wire,
which ``Cluster.p2p_ms`` prices). It is measured once per machine at profile time
(``execute/overhead_probe.py``), stored in the profile JSON, and priced by the cost model
(``plan/costs.py``) and the simulator (``simulate/engine.py``). A profile without it (every
profile written before it existed, and the published ones) has none: all zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dapple.profile.milliseconds import MsTable, ms_table

__all__ = ["ActionOverhead", "NO_OVERHEAD", "OVERHEAD_KINDS", "overhead_from_dict"]

# JSON key -> field: the compute kinds are named as the actions' text writes them (``1F0``)
OVERHEAD_KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight", "send": "send", "recv": "recv"}


@dataclass(frozen=True)
class ActionOverhead(MsTable):
    """Milliseconds the executor spends per action of each kind besides the layers' compute
    (``forward``: F, ``backward``: B, ``backward_input``: I, ``backward_weight``: W) and
    per transfer besides the wire (``send``, ``recv``). All zero: nothing is charged."""

    JSON_NAME = "action_overhead_ms"
    KEYS = OVERHEAD_KINDS
    FIX = "write milliseconds per action"

    forward: float = 0.0
    backward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    send: float = 0.0
    recv: float = 0.0

    def of(self, kind: str) -> float:
        """The overhead of one action of ``kind`` (a key of ``OVERHEAD_KINDS``)."""
        return getattr(self, OVERHEAD_KINDS[kind])

    def per_microbatch(self, receives: bool, sends: bool) -> tuple[float, float]:
        """(forward, backward) overhead a stage pays per micro-batch under a schedule with one
        full backward per micro-batch: its F (B) plus the transfers around it, a receive of
        the activation (gradient) when the stage has a neighbour to receive it from and a send
        of its output (input gradient) when it has one to send it to. ``receives``: the stage
        has an upstream neighbour; ``sends``: a downstream one."""
        forward = self.forward + (self.recv if receives else 0.0) + (self.send if sends else 0.0)
        backward = self.backward + (self.recv if sends else 0.0) + (self.send if receives else 0.0)
        return forward, backward


NO_OVERHEAD = ActionOverhead()


def overhead_from_dict(data: Any, source: str = "action_overhead_ms") -> ActionOverhead:
    """The JSON form (``{"F": ms, "B": ms, "I": ms, "W": ms, "send": ms, "recv": ms}``; a kind
    left out costs 0) as an ``ActionOverhead``; unknown kinds are refused."""
    return ActionOverhead(**ms_table(data, OVERHEAD_KINDS, source, "kind", "write milliseconds per action"))
