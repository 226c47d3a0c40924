"""Schedules as per-stage action lists, shared by the simulator and the executor.

Like ``torch.distributed.pipelining``'s schedules, a schedule is data: for every stage an
ordered list of actions. Compute actions are F (forward of one micro-batch), B (backward;
with out-of-order backprop only the input-gradient half, ooo-backprop sec. 3) and W (the
deferred weight-gradient half). Communication actions move a micro-batch boundary between
adjacent stages (DAPPLE 5.2.2 split-concat when their widths differ). ALLREDUCE syncs the
stage's gradients among its replicas once its last backward is done (DAPPLE 5.2.3).

``layers`` (stage-local, half-open) narrows an action to some of the stage's layers: a W
with layers computes only those layers' weight gradients (the per-layer ending phase of
ooo-backprop Algorithm 2), and an ALLREDUCE with layers is an asynchronous gradient bucket
(one of ``plan.buckets.bucket_layers``, listed in launch order) that syncs only those
layers' gradients while the stage computes on. ALLREDUCE actions tell the simulator where
buckets start; the executor starts its buckets itself when their gradients are final
(``execute/grad_sync.py``) and reads them as markers only.

Every replica of a stage runs the same list; a replica handles its slice of each
micro-batch.

Text form. ``Action.text`` writes an action the way ``torch.distributed.pipelining``
prints its schedules -- stage, kind token, micro-batch -- so a schedule can be read,
diffed and typed by hand: ``1F0`` (stage 1, forward of micro-batch 0), ``1B0``, ``1W0``,
``0SEND_F0`` / ``1RECV_F0`` (the activation of micro-batch 0 crossing boundary 0),
``1SEND_B0`` / ``0RECV_B0`` (its gradient coming back), ``0ALLREDUCE``, and a ``[lo:hi]``
suffix for ``layers`` (``0W3[2:4]``, ``0ALLREDUCE[0:2]``). The grammar is
``<stage><KIND>[<microbatch>][[<lo>:<hi>]]``; ``Action.parse`` inverts it exactly and
``format_actions`` / ``parse_actions`` do the same for whole schedules, one line per stage.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Sequence


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"
    ALLREDUCE = "allreduce"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.W)


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    microbatch: int | None = None
    layers: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """Short form without the stage: ``F3``, ``W7[2:3]``, ``allreduce[0:1]``."""
        text = self.kind.value if self.microbatch is None else f"{self.kind.value}{self.microbatch}"
        if self.layers is not None:
            text += f"[{self.layers[0]}:{self.layers[1]}]"
        return text

    @property
    def text(self) -> str:
        """Text form with the stage first: ``1F0``, ``0W3[2:4]``, ``1RECV_F0``, ``0ALLREDUCE``."""
        text = f"{self.stage}{TOKENS[self.kind]}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.layers is not None:
            text += f"[{self.layers[0]}:{self.layers[1]}]"
        return text

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action whose ``text`` is ``text``; ValueError naming it and the grammar otherwise."""
        match = _PATTERN.fullmatch(text)
        if match is None:
            raise ValueError(f"cannot parse action {text!r}: expected {GRAMMAR}")
        microbatch = match["microbatch"]
        layers = None if match["lo"] is None else (int(match["lo"]), int(match["hi"]))
        return cls(_KINDS[match["kind"]], int(match["stage"]), None if microbatch is None else int(microbatch), layers)

    def __str__(self) -> str:
        """The text form (``0RECV_B0``), as schedules print and error messages name actions."""
        return self.text


# Kind tokens of the text form: torch.distributed.pipelining's F, B, W and SEND_F / RECV_F
# (activations) / SEND_B / RECV_B (gradients); ALLREDUCE for the replicas' gradient sync.
TOKENS: dict[Kind, str] = {
    Kind.F: "F",
    Kind.B: "B",
    Kind.W: "W",
    Kind.RECV_ACT: "RECV_F",
    Kind.SEND_ACT: "SEND_F",
    Kind.RECV_GRAD: "RECV_B",
    Kind.SEND_GRAD: "SEND_B",
    Kind.ALLREDUCE: "ALLREDUCE",
}
_KINDS = {token: kind for kind, token in TOKENS.items()}
# longest token first, so that the alternation never stops at a prefix of another token
_ALTERNATIVES = "|".join(sorted(_KINDS, key=len, reverse=True))
_NUMBER = "0|[1-9][0-9]*"  # no leading zeros: every action has exactly one text
_PATTERN = re.compile(
    rf"(?P<stage>{_NUMBER})(?P<kind>{_ALTERNATIVES})(?P<microbatch>{_NUMBER})?(?:\[(?P<lo>{_NUMBER}):(?P<hi>{_NUMBER})\])?"
)
GRAMMAR = (
    "<stage><KIND>[<microbatch>][[<lo>:<hi>]] with KIND one of "
    + ", ".join(TOKENS.values())
    + " and non-negative integers without leading zeros, e.g. '1F0', '0W3[2:4]', '1RECV_F0', '0ALLREDUCE[0:2]'"
)


def format_actions(actions_by_stage: Sequence[Sequence[Action]], compute_only: bool = False) -> str:
    """A schedule as text: one line per stage, its actions' ``text`` separated by spaces.

    ``compute_only`` keeps F, B and W (the order a timeline picture shows); otherwise the
    line is the full list the simulator and the executor interpret.
    """
    lines = []
    for actions in actions_by_stage:
        lines.append(" ".join(a.text for a in actions if a.kind.is_compute or not compute_only))
    return "\n".join(lines)


def parse_actions(text: str) -> tuple[tuple[Action, ...], ...]:
    """The per-stage lists ``format_actions`` wrote as ``text`` (blank lines are skipped)."""
    return tuple(tuple(Action.parse(token) for token in line.split()) for line in text.splitlines() if line.strip())
