"""Out-of-order backprop schedules: where the deferred weight-gradient work (W) goes.

ooo-backprop (sec. 3) splits a layer's backward into the output-gradient work dO (our I:
the gradient with respect to the stage input, which the previous stage waits for) and
the weight-gradient work dW (our W, needed only by the optimizer). *Gradient
fast-forwarding* (sec. 5.2) runs every I first and sends its result upstream at once, so
the previous stage starts its own backward while this stage still owes W. The builder
decides per stage which backward it runs: I (followed by W) where the stage's cap is 0 or
more, the full B where it is -1; nothing downstream decides it again.

Placement (``ooo_compute_orders``). The F/B order of the base schedule (DAPPLE early
backward or GPipe) is kept exactly (its B becoming I on a splitting stage); W actions are
inserted by a list scheduler that plays
the pipeline with unit costs (F = B = W = 1, free transfers):

* when the stage's next F or B can start (its input or gradient has arrived) it runs;
* when it cannot (the stage would idle: warm-up tail, waits inside the steady phase, the
  cool-down bubbles), the oldest pending W fills the slot;
* a stage never holds more than ``caps[i]`` micro-batches (F done, W not done): before an
  F that would exceed the cap, a pending W runs first. This is the memory budget of the
  deferral. The default cap is the number the first stage holds under early backward
  (K_0): every stage may hold as many micro-batches as the most loaded stage already
  does, so for balanced stages the peak over devices is that of DAPPLE without ooo (the
  same argument as the zero-bubble "H1" schedule). A planner that knows the memory of
  each device lowers caps (``plan.ooo_in_flight``, down to K_i); a cap of 0
  defers nothing on that stage: each W runs right after its B (the gradient still leaves
  first), which keeps no layer-output gradients across other work; a cap of -1 does not
  split that stage's backward at all (plain B, no W, nothing extra kept);
* on a stage that recomputes, at most one recomputed micro-batch waits for its W: before
  the B of the next one (which replays its forward) the waiting W runs. Otherwise the
  replayed activations of every deferred micro-batch would stay alive until the end --
  the known failure of weight-gradient deferral combined with activation checkpointing;
* what is still pending after the last B runs at the end, oldest first.

Because F/B order is unchanged and a W depends only on its own B, the result cannot
deadlock when the base schedule does not. With unit costs, S = 4, M = 8 this gives the
bubble of the zero-bubble H1 schedule: (S-1)(F+B-W) instead of (S-1)(F+B+W).

Ending phase (ooo-backprop 5.1, Algorithm 2). On a replicated stage the gradient
AllReduce (DAPPLE 5.2.3) of a layer can only start once its last W is done. The last W is
therefore split per layer, so that the gradients of the last layers can be summed while the
W of the earlier layers still runs. Gradients travel in the buckets of
``plan.buckets.bucket_layers`` (DDP-style, filled from the last layer back), launched
strictly in that order -- the order every replica of the executor (``execute/grad_sync.py``)
issues its collectives in. One ALLREDUCE per bucket follows the W part that completes the
bucket's layers, and never precedes the previous bucket's. The parts run in Algorithm 2's
order: layers L-1 down to k, then the first k layers in forward order 0..k-1. With buckets
launched in this fixed order k = 0 (conventional order) finishes every bucket's layers
earliest -- bucket j can only start once the layers of buckets 0..j, all layers from its
first one up, are done -- so the planner searches no other k; a plan may still ask for one.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.buckets import BUCKET_BYTES, bucket_layers
from lightning_dapple.plan.schedule_table import schedule_spec
from lightning_dapple.plan.warmup import warmup_counts
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.builders import compute_order, with_communication

__all__ = [
    "build_ooo_schedule",
    "default_caps",
    "ending_buckets",
    "ending_order",
    "ooo_compute_orders",
]


def default_caps(name: str, num_stages: int, micro_batches: int, warmups: Sequence[int]) -> list[int]:
    """K_0 for every stage under early backward, M under GPipe (see the module docstring)."""
    if schedule_spec(name).holds_every_micro_batch:
        return [micro_batches] * num_stages
    top = max(min(int(k), micro_batches) for k in warmups)
    return [top] * num_stages


def ooo_compute_orders(
    name: str,
    num_stages: int,
    micro_batches: int,
    warmups: Sequence[int],
    caps: Sequence[int] | None = None,
    recomputed: Sequence[frozenset[int]] | None = None,
    recomputed_waiting: int = 1,
) -> list[list[Action]]:
    """Per stage: the base schedule's F/B order with W actions placed as described above.

    ``recomputed[s]``: micro-batches stage s recomputes; at most ``recomputed_waiting`` of
    them may wait for their W when a B starts."""
    if caps is None:
        caps = default_caps(name, num_stages, micro_batches, warmups)
    require(len(caps) == num_stages, "ooo caps", f"has {len(caps)} entries for {num_stages} stages", "give one cap per stage")
    base = [compute_order(name, s, num_stages, micro_batches, warmups[s]) for s in range(num_stages)]
    replayed = [frozenset() for _ in range(num_stages)] if recomputed is None else list(recomputed)
    placement = _WPlacement(base, caps, replayed, recomputed_waiting)
    placement.run()
    return placement.out


class _WPlacement:
    """Places the W actions into the stages' F/B orders on a unit-time clock per stage.

    Every F, B and W takes one unit; an F waits for its activation from the stage before,
    a B for its gradient from the stage after. A stage with deferred W work runs one W
    whenever its next F/B would have to wait (the bubble it fills, ooo-backprop sec. 3) or
    when it already holds its cap of micro-batches; cap 0 runs each W right after its B,
    cap -1 does not split the backward (the stage keeps full B actions; every other stage's
    B is emitted as I). Stages decide in clock order, so the placement is
    the one the simulator's timing of unit costs would produce.
    """

    def __init__(self, base: list[list[Action]], caps: Sequence[int], replayed: list[frozenset[int]], recomputed_waiting: int) -> None:
        num_stages = len(base)
        self.base = base
        # a stage must be able to hold what its own F/B order holds before any W
        self.limit = [max(int(cap), _held_by_order(order)) for cap, order in zip(caps, base)]
        self.eager = [int(cap) == 0 for cap in caps]
        self.whole = [int(cap) < 0 for cap in caps]
        self.replayed = replayed
        self.recomputed_waiting = recomputed_waiting
        self.clock = [0.0] * num_stages
        self.pc = [0] * num_stages
        self.held = [0] * num_stages
        self.pending: list[deque[int]] = [deque() for _ in range(num_stages)]
        self.out: list[list[Action]] = [[] for _ in range(num_stages)]
        self.finished = [False] * num_stages
        self.act_at: list[dict[int, float]] = [{} for _ in range(num_stages)]  # activation arrival at stage s
        self.grad_at: list[dict[int, float]] = [{} for _ in range(num_stages)]  # gradient arrival at stage s

    def run(self) -> None:
        num_stages = len(self.base)
        while not all(self.finished):
            for s in sorted(range(num_stages), key=lambda i: (self.clock[i], i)):
                if not self.finished[s] and self._advance(s):
                    break
            else:  # pragma: no cover - the base orders are deadlock-free
                raise RuntimeError("out-of-order placement made no progress; the base schedule deadlocks")

    def _run_w(self, s: int, mb: int | None = None) -> None:
        if mb is None:
            mb = self.pending[s].popleft()
        else:
            self.pending[s].remove(mb)
        self.out[s].append(Action(Kind.W, s, mb))
        self.clock[s] += 1.0
        self.held[s] -= 1

    def _run(self, s: int, action: Action, start: float) -> None:
        mb = action.microbatch
        assert mb is not None
        split = action.kind is Kind.B and not self.whole[s]  # its weight gradients go to W actions
        self.out[s].append(Action(Kind.I, s, mb) if split else action)
        self.pc[s] += 1
        self.clock[s] = start + 1.0
        if action.kind is Kind.F:
            self.held[s] += 1
            if s + 1 < len(self.base):
                self.act_at[s + 1][mb] = self.clock[s]
            return
        self.pending[s].append(mb)
        if s > 0:
            self.grad_at[s - 1][mb] = self.clock[s]
        if self.eager[s]:
            self._run_w(s, mb)
        elif self.whole[s]:  # not split: the B above was the whole backward
            self.pending[s].pop()
            self.held[s] -= 1

    def _arrival(self, s: int, action: Action) -> float | None:
        """When the input ``action`` waits for is there (None: not yet known)."""
        mb = action.microbatch
        assert mb is not None
        if action.kind is Kind.F:
            return 0.0 if s == 0 else self.act_at[s].get(mb)
        return 0.0 if s == len(self.base) - 1 else self.grad_at[s].get(mb)

    def _advance(self, s: int) -> bool:
        """Take one decision for stage s; False when it must wait for an unknown arrival."""
        pending = self.pending[s]
        if self.pc[s] >= len(self.base[s]):
            if pending:
                self._run_w(s)
            else:
                self.finished[s] = True
            return True
        action = self.base[s][self.pc[s]]
        arrival = self._arrival(s, action)
        if action.kind is Kind.B and action.microbatch in self.replayed[s]:
            waiting = [m for m in pending if m in self.replayed[s]]
            if len(waiting) >= max(1, self.recomputed_waiting):
                self._run_w(s, waiting[0])  # free the replayed activations before replaying more
                return True
        over_cap = action.kind is Kind.F and self.held[s] >= self.limit[s] and bool(pending)
        if not over_cap and arrival is not None and arrival <= self.clock[s]:
            self._run(s, action, self.clock[s])
            return True
        if pending:
            self._run_w(s)  # fill the slot the stage would otherwise idle in (or make room)
            return True
        if arrival is not None:
            self._run(s, action, arrival)
            return True
        return False


def _held_by_order(order: Sequence[Action]) -> int:
    count = peak = 0
    for action in order:
        if action.kind is Kind.F:
            count += 1
            peak = max(peak, count)
        elif action.kind is Kind.B:
            count -= 1
    return peak


def _recomputed_by_order(order: Sequence[Action], mode: str, micro_batches: int) -> frozenset[int]:
    """``Schedule.recomputed`` for an F/B order (W actions do not change it)."""
    probe = Schedule("probe", 1, micro_batches, (1,), (tuple(Action(a.kind, 0, a.microbatch) for a in order),), recompute=(mode,))
    return probe.recomputed(0)


def ending_order(num_layers: int, first_k: int | None) -> list[int]:
    """Stage-local layer order of the last W's parts (Algorithm 2, lines 3-7)."""
    k = max(0, min(int(first_k or 0), num_layers))
    return list(range(num_layers - 1, k - 1, -1)) + list(range(k))


def ending_buckets(
    num_layers: int, first_k: int | None, param_bytes: Sequence[float] | None = None, bucket_bytes: int = BUCKET_BYTES
) -> list[tuple[int, tuple[int, int] | None]]:
    """The ending phase of a replicated stage: (layer of a W part, bucket to launch after
    it or None) in list order. Buckets are ``bucket_layers``' (one bucket of the whole
    stage when ``param_bytes`` is unknown), each launched after the part that completes
    its layers and after the bucket before it."""
    sizes = list(param_bytes) if param_bytes is not None else [0.0] * num_layers
    require(len(sizes) == num_layers, "param_bytes", f"has {len(sizes)} entries for {num_layers} layers", "give one size per layer of the stage")
    buckets = bucket_layers(sizes, 0, num_layers, bucket_bytes)
    done: set[int] = set()
    out: list[tuple[int, tuple[int, int] | None]] = []
    for layer in ending_order(num_layers, first_k):
        done.add(layer)
        out.append((layer, None))
        while buckets and all(i in done for i in range(*buckets[0])):
            out.append((layer, buckets.pop(0)))
    return out


def _with_buckets(
    actions: list[Action], stage: int, num_layers: int, first_k: int | None, param_bytes: Sequence[float] | None, bucket_bytes: int
) -> list[Action]:
    """Split the stage's last W per layer and put each bucket's ALLREDUCE after the part
    completing it (``ending_buckets``); the whole-stage ALLREDUCE is then no longer needed."""
    last_w = max(i for i, a in enumerate(actions) if a.kind is Kind.W)
    mb = actions[last_w].microbatch
    parts: list[Action] = []
    for layer, bucket in ending_buckets(num_layers, first_k, param_bytes, bucket_bytes):
        if bucket is None:
            parts.append(Action(Kind.W, stage, mb, (layer, layer + 1)))
        else:
            parts.append(Action(Kind.ALLREDUCE, stage, None, bucket))
    rest = [a for i, a in enumerate(actions) if i != last_w and not (a.kind is Kind.ALLREDUCE and a.layers is None)]
    return rest[:last_w] + parts + rest[last_w:]


def build_ooo_schedule(
    name: str,
    num_stages: int,
    micro_batches: int,
    warmups: Sequence[int] | None = None,
    caps: Sequence[int] | None = None,
    layer_counts: Sequence[int] | None = None,
    replicated: Sequence[bool] | None = None,
    first_k: int | None = None,
    recompute: Sequence[str] | None = None,
    param_bytes: Sequence[Sequence[float]] | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> Schedule:
    """The out-of-order version of schedule ``name`` (see the module docstring).

    ``layer_counts`` and ``replicated`` (per stage) enable the per-layer ending phase with
    bucketed AllReduce on replicated stages; without them every stage ends with one W and
    one whole-stage ALLREDUCE. ``param_bytes[s]`` (per layer of stage s) and
    ``bucket_bytes`` make the buckets those of ``bucket_layers``, the executor's; without
    them a replicated stage's ending phase has one bucket.
    """
    require(num_stages >= 1, "num_stages", f"is {num_stages}", "use at least one stage")
    require(micro_batches >= 1, "micro_batches", f"is {micro_batches}", "use at least one micro-batch")
    if warmups is None:
        warmups = warmup_counts(num_stages, micro_batches, "PA", schedule=name)
    every = schedule_spec(name).holds_every_micro_batch
    if every:
        warmups = [micro_batches] * num_stages
    warmups = [max(1, min(int(k), micro_batches)) for k in warmups]
    if caps is None:
        caps = default_caps(name, num_stages, micro_batches, warmups)
    caps = [int(c) if int(c) <= 0 else (micro_batches if every else max(int(c), k)) for c, k in zip(caps, warmups)]
    modes = list(recompute) if recompute is not None else ["never"] * num_stages
    replayed = [
        _recomputed_by_order(compute_order(name, s, num_stages, micro_batches, warmups[s]), modes[s], micro_batches)
        for s in range(num_stages)
    ]
    orders = ooo_compute_orders(name, num_stages, micro_batches, warmups, caps, replayed)
    lists = []
    for s, order in enumerate(orders):
        actions = with_communication(order, s, num_stages)
        if layer_counts is not None and replicated is not None and replicated[s] and layer_counts[s] > 0 and caps[s] >= 0:
            sizes = param_bytes[s] if param_bytes is not None else None
            actions = _with_buckets(actions, s, int(layer_counts[s]), first_k, sizes, bucket_bytes)
        lists.append(tuple(actions))
    return Schedule(
        f"{name}+ooo",
        num_stages,
        micro_batches,
        tuple(warmups),
        tuple(lists),
        recompute=tuple(recompute) if recompute is not None else (),
        in_flight_caps=tuple(caps),
        first_k=first_k,
    )
