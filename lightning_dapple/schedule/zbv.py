"""ZB-V: the zero-bubble V schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 6).

Placement. 2P stages on P device groups in a V: stage k on group k for k < P and on group
2P-1-k after, so a micro-batch goes down the groups (chunk 0) and back up (chunk 1); the
loss is computed on group 0, and the two middle stages P-1 and P share group P-1 (a
local hand-off). Each group holds one chunk of each leg.

Split backward. Every backward is an I (input gradient only, ``Kind.I``: the gradient the
previous stage waits for) followed later by its W (weight gradients, ``Kind.W``), as in
the zero-bubble paper's B/W split (sec. 2) and ooo-backprop's gradient fast-forwarding.
W work is needed by no other device, so it fills the slots where a group would otherwise
wait.

Order of each group (``zbv_orders``), found by playing the pipeline with unit costs
(F = I = W = 1 per chunk, free transfers: the setting in which the paper shows ZB-V's
bubble vanishing), like the paper's own list scheduler (sec. 3.1):

* at each step a free group runs, in this priority: the oldest I whose gradient (or, on
  the last stage, whose forward) is there -- the critical path of the backward; else the
  forward of chunk 1 (the V's second leg, which leads to the loss); else a forward of
  chunk 0; else the oldest pending W;
* a group holds at most K chunk micro-batches (F done, W not done: the memory its
  activations need). A chunk-0 forward leaves one of the K free, so that the chunk-1
  forward of a micro-batch the group already holds can always run: otherwise a group
  full of chunk-0 micro-batches would wait for backwards that cannot start;
* K defaults to 2P for every group (``plan.warmup.chunked_warmup_counts``): the P
  micro-batches of two chunks each that the first device of 1F1B holds, so ZB-V needs
  the activation memory of 1F1B's most loaded device (the paper's claim for ZB-V).

With unit costs no schedule can take less than 6M + P - 1 units: every group computes
6M, and the last group cannot start before the first micro-batch has crossed the P - 1
groups before it. For M >= P this list scheduler stays within a constant of that bound
(exactly on it for P = 2 and 4; at most 2 units over for P <= 6), so the bubble fraction,
about (P - 1) / (6M + P - 1), tends to zero with M.

Each stage runs its forwards, I and W in micro-batch order, and the result is dependency
consistent by construction; the simulator replays it with the real costs.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.warmup import chunked_warmup_counts
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.chunked import chunked_placement, schedule_from_orders


class _Play:
    """The unit-cost game of ``zbv_orders``: what each stage has done, and when."""

    def __init__(self, num_groups: int, micro_batches: int, caps: Sequence[int]) -> None:
        self.groups = num_groups
        self.stages = 2 * num_groups
        self.micro_batches = micro_batches
        self.caps = list(caps)
        self.placement = chunked_placement("zbv", num_groups, 2)
        self.ends: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, mb) -> end step
        self.next_f = [0] * self.stages
        self.next_i = [0] * self.stages
        self.pending_w: list[list[Action]] = [[] for _ in range(num_groups)]
        self.held = [0] * num_groups
        self.orders: list[list[Action]] = [[] for _ in range(num_groups)]

    def done_by(self, kind: Kind, stage: int, mb: int, now: int) -> bool:
        end = self.ends.get((kind, stage, mb))
        return end is not None and end <= now

    def ready_backward(self, stage: int, now: int) -> bool:
        mb = self.next_i[stage]
        if mb >= self.micro_batches or not self.done_by(Kind.F, stage, mb, now):
            return False
        return stage == self.stages - 1 or self.done_by(Kind.I, stage + 1, mb, now)

    def ready_forward(self, stage: int, now: int) -> bool:
        mb = self.next_f[stage]
        if mb >= self.micro_batches:
            return False
        return stage == 0 or self.done_by(Kind.F, stage - 1, mb, now)

    def choose(self, group: int, now: int) -> Action | None:
        """The action ``group`` runs at step ``now`` (module docstring's priority), or None."""
        chunk0, chunk1 = group, 2 * self.groups - 1 - group
        backwards = [s for s in (chunk1, chunk0) if self.ready_backward(s, now)]
        if backwards:
            stage = min(backwards, key=lambda s: self.next_i[s])
            return Action(Kind.I, stage, self.next_i[stage])
        if self.ready_forward(chunk1, now) and self.held[group] < self.caps[group]:
            return Action(Kind.F, chunk1, self.next_f[chunk1])
        if self.ready_forward(chunk0, now) and self.held[group] < self.caps[group] - 1:
            return Action(Kind.F, chunk0, self.next_f[chunk0])
        if self.pending_w[group]:
            return self.pending_w[group].pop(0)
        return None

    def run(self, action: Action, group: int, now: int) -> None:
        assert action.microbatch is not None
        self.ends[(action.kind, action.stage, action.microbatch)] = now + 1
        self.orders[group].append(action)
        if action.kind is Kind.F:
            self.next_f[action.stage] += 1
            self.held[group] += 1
        elif action.kind is Kind.I:
            self.next_i[action.stage] += 1
            self.pending_w[group].append(Action(Kind.W, action.stage, action.microbatch))
        else:
            self.held[group] -= 1

    def play(self) -> list[list[Action]]:
        total = 3 * self.stages * self.micro_batches
        now = 0
        while sum(len(order) for order in self.orders) < total:
            chosen = [(group, self.choose(group, now)) for group in range(self.groups)]
            moved = [(group, action) for group, action in chosen if action is not None]
            if not moved and not any(end > now for end in self.ends.values()):
                raise RuntimeError(f"ZB-V construction stuck at step {now} (caps {self.caps})")
            for group, action in moved:
                self.run(action, group, now)
            now += 1
        return self.orders


def zbv_orders(num_groups: int, micro_batches: int, caps: Sequence[int]) -> list[list[Action]]:
    """Each group's compute order (F, I, W) of ZB-V with in-flight caps ``caps``."""
    return _Play(num_groups, micro_batches, caps).play()


def build_zbv_schedule(
    num_groups: int,
    micro_batches: int,
    warmups: Sequence[int] | None = None,
    policy: str = "PA",
    recompute: Sequence[str] = (),
) -> Schedule:
    """ZB-V on ``num_groups`` groups (2 chunks each) for M micro-batches.

    ``warmups``: K per group, the chunk micro-batches a group may hold (default
    ``chunked_warmup_counts`` under ``policy``); at least 2, so that a group can hold a
    micro-batch in each of its chunks. ``recompute``: a mode per stage.
    """
    require(num_groups >= 1, "num_groups", f"is {num_groups}", "use at least one device group")
    require(micro_batches >= 1, "micro_batches", f"is {micro_batches}", "use at least one micro-batch")
    if warmups is None:
        warmups = chunked_warmup_counts(num_groups, 2, micro_batches, policy, "zbv")
    require(len(warmups) == num_groups, "warmups", f"has {len(warmups)} entries for {num_groups} device groups", "give one K per device group")
    require(min(warmups) >= 2, "warmups", f"is {list(warmups)}", "let every group hold at least 2 chunk micro-batches (K >= 2), one in each chunk")
    placement = chunked_placement("zbv", num_groups, 2)
    orders = zbv_orders(num_groups, micro_batches, warmups)
    return schedule_from_orders("zbv", micro_batches, placement, orders, [warmups[g] for g in placement], recompute)
