"""Schedules as per-stage action lists, shared by the simulator and the executor.

Like ``torch.distributed.pipelining``'s schedules, a schedule is data: for every stage an
ordered list of actions. Compute actions are F (forward of one micro-batch), B (its full
backward: input and weight gradients), I (the input-gradient half only, ooo-backprop sec. 3:
the gradient the previous stage waits for) and W (the deferred weight-gradient half of a
micro-batch whose backward was an I). As in ``torch.distributed.pipelining``
(``FULL_BACKWARD``, ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT``) the kind says which: the
schedule builder decides it once, and the simulator and the executor only read it. Communication actions move a micro-batch boundary between
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
diffed and typed by hand: ``1F0`` (stage 1, forward of micro-batch 0), ``1B0``, ``1I0``, ``1W0``,
``0SEND_F0`` / ``1RECV_F0`` (the activation of micro-batch 0 crossing boundary 0),
``1SEND_B0`` / ``0RECV_B0`` (its gradient coming back), ``0ALLREDUCE``, and a ``[lo:hi]``
suffix for ``layers`` (``0W3[2:4]``, ``0ALLREDUCE[0:2]``). The grammar is
``<stage><KIND>[<microbatch>][[<lo>:<hi>]]``; ``Action.parse`` inverts it exactly and
``format_actions`` / ``parse_actions`` do the same for whole schedules, one line per stage.

``Schedule`` bundles the per-stage lists with what every consumer reads beside them (K_i,
recomputation modes, in-flight caps), and ``stash_walk`` is the memory rule of any such list;
both serve every builder (``builders.py``, ``ooo.py``) and therefore live here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence


class Kind(str, Enum):
    F = "F"
    B = "B"  # full backward: input and weight gradients
    I = "I"  # noqa: E741 -- input-gradient backward only; the micro-batch's W actions follow
    W = "W"
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"
    ALLREDUCE = "allreduce"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.F, Kind.B, Kind.I, Kind.W)

    @property
    def is_backward(self) -> bool:
        """B or I: the action that consumes the output gradient and sends the input gradient."""
        return self in (Kind.B, Kind.I)

    @property
    def block(self) -> str:
        """The timeline block a compute action draws: both backwards are a ``B`` block."""
        return "B" if self.is_backward else self.value


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
    Kind.I: "I",
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


@dataclass(frozen=True)
class Schedule:
    """An action list per stage; ``warmups`` are the K_i the lists were built with."""

    name: str
    num_stages: int
    micro_batches: int
    warmups: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    # per stage: "never", "always" or "except_last" (empty: never everywhere)
    recompute: tuple[str, ...] = ()
    # out-of-order backprop: max micro-batches a stage holds (F done, W not done), and
    # Algorithm 2's k used for the per-layer ending phase of replicated stages
    in_flight_caps: tuple[int, ...] = ()
    first_k: int | None = None
    # Several stages per device group (interleaved, V): the device group of each stage and,
    # per group, the one order its ranks run the actions of all its stages in (each stage's
    # actions keep their order in ``actions``). Empty: stage s alone on group s.
    placement: tuple[int, ...] = ()
    orders: tuple[tuple[Action, ...], ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.orders) if self.orders else self.num_stages

    def group_of(self, stage: int) -> int:
        return self.placement[stage] if self.placement else stage

    def group_actions(self, group: int) -> tuple[Action, ...]:
        """What the ranks of device ``group`` run, in order: the interleaving of its stages' lists."""
        return self.orders[group] if self.orders else self.actions[group]

    def compute(self, stage: int) -> list[Action]:
        return [action for action in self.actions[stage] if action.kind.is_compute]

    def describe(self, stage: int) -> str:
        return " ".join(a.label for a in self.compute(stage))

    def splits(self, stage: int) -> bool:
        """Whether the stage defers weight gradients of some micro-batch (lists an I)."""
        return any(action.kind is Kind.I for action in self.actions[stage])

    def recompute_mode(self, stage: int) -> str:
        return self.recompute[stage] if stage < len(self.recompute) else "never"

    def recomputed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose stage forward is recomputed before their backward.

        ``always``: all. ``except_last``: all but those whose backward comes before any
        other forward on the stage -- the micro-batch last in flight (torchgpipe's
        'except_last'; under GPipe only micro-batch M-1, under early backward also every
        micro-batch of a stage with K_i = 1), whose recomputation would save no memory.
        On a device group that runs several stages (chunks) "other forward" means any
        forward of the group: the chunks share the device's memory, so a micro-batch
        whose stash outlives another chunk's forward is recomputed too.
        """
        mode = self.recompute_mode(stage)
        if mode == "never":
            return frozenset()
        every = range(self.micro_batches)
        if mode == "always":
            return frozenset(every)
        kept: set[int] = set()
        last_forward: tuple[int, int | None] | None = None
        for action in self.group_actions(self.group_of(stage)):
            if action.kind is Kind.F:
                last_forward = (action.stage, action.microbatch)
            elif action.kind.is_backward and action.stage == stage and (stage, action.microbatch) == last_forward:
                kept.add(action.microbatch)  # type: ignore[arg-type]
        return frozenset(mb for mb in every if mb not in kept)


def stash_walk(
    compute: Sequence[Action],
    recomputed: frozenset[int] | set[int],
    stash: float,
    input_bytes: float = 0.0,
    wgrad_bytes: float = 0.0,
    kept_bytes: float | None = None,
) -> tuple[float, int]:
    """(peak stashed bytes, peak micro-batches in flight) of one stage's compute list.

    The rule the executor measures by (``execute/runner.py``) and the planner estimates by:

    * F of a micro-batch keeps ``stash`` bytes, or only its stage input (``input_bytes``)
      when the micro-batch is recomputed;
    * a backward (B or I) of a recomputed micro-batch rebuilds the stash (input + stash
      held from then on);
    * B releases the micro-batch. I frees its graph too, except what its W actions need
      (ooo-backprop sec. 3: each deferred layer's input and output gradient): with
      ``kept_bytes`` (what the executor measures, ``WeightGradStore.held_bytes``) the
      micro-batch holds exactly that from then on; without it, the planner's bound, the
      stash stays charged and the layer-output gradients (``wgrad_bytes``) are added. The
      micro-batch is released by its last W.

    Peaks are taken after every step, so the result bounds the stash at any time.
    """
    stages = {action.stage for action in compute}
    return group_stash_walk(
        compute,
        {s: frozenset(recomputed) for s in stages},
        {s: stash for s in stages},
        {s: input_bytes for s in stages},
        {s: wgrad_bytes for s in stages},
        None if kept_bytes is None else {s: kept_bytes for s in stages},
    )


def group_stash_walk(
    compute: Sequence[Action],
    recomputed: Mapping[int, frozenset[int]],
    stash: Mapping[int, float],
    input_bytes: Mapping[int, float],
    wgrad_bytes: Mapping[int, float],
    kept_bytes: Mapping[int, float] | None = None,
) -> tuple[float, int]:
    """``stash_walk`` over a device group's merged compute order: each action keeps the
    bytes of its own stage (chunk), and the peaks are those of the device, which holds
    every chunk's micro-batches at once (the count is in chunk micro-batches)."""
    last_w: dict[tuple[int, int], int] = {}
    for index, action in enumerate(compute):
        if action.kind is Kind.W and action.microbatch is not None:
            last_w[(action.stage, action.microbatch)] = index
    held: dict[tuple[int, int], float] = {}
    peak = 0.0
    peak_count = 0
    for index, action in enumerate(compute):
        mb, s = action.microbatch, action.stage
        if mb is None:
            continue
        key = (s, mb)
        replayed = mb in recomputed[s]
        if action.kind is Kind.F:
            held[key] = input_bytes[s] if replayed else stash[s]
            peak_count = max(peak_count, len(held))
        elif action.kind.is_backward:
            if replayed:
                held[key] = held.get(key, 0.0) + stash[s]
                peak = max(peak, sum(held.values()))
            if action.kind is Kind.I:
                held[key] = kept_bytes[s] if kept_bytes is not None else held.get(key, 0.0) + wgrad_bytes[s]
            else:
                peak = max(peak, sum(held.values()))
                held.pop(key, None)
                continue
        elif action.kind is Kind.W and last_w.get(key) == index:
            held.pop(key, None)
            continue
        peak = max(peak, sum(held.values()))
    return peak, peak_count
