"""Discrete-event simulation of a schedule: the ground truth the planner's formula approximates.

DAPPLE 4.1 prices a plan with a closed formula (warm-up + steady + ending phase, formulas
1-2) that, as the paper says, "does not model [the] internal bubbles" of the pivot stage.
This module instead *runs* a :class:`~lightning_dapple.schedule.Schedule` -- the very action
lists the multi-process executor interprets -- against the per-stage costs of
:func:`~lightning_dapple.plan.costs.stage_costs`, and reports what happens: when every F, B,
W and AllReduce of every device starts and ends (the pictures of DAPPLE Fig. 3 and 4), the
step latency, the bubble fraction and how many micro-batches each stage holds at once
(DAPPLE 3.2 / 5.3: K_i under early backward, M under GPipe, gpipe.txt sec. 2).

Model (one "clock" per device group; all replicas of a stage run the same list on equal
slices, DAPPLE 5.2.2, so a group is simulated once and its timeline copied to each of its
devices). A group runs one stage, or several (the chunks of interleaved 1F1B and ZB-V,
``Schedule.placement``), in one merged order (``Schedule.orders``):

* a group executes its order strictly in order; compute actions (F, B, W) and ALLREDUCE
  occupy the group, nothing else does;
* F(mb) on stage s > 0 cannot start before the activation of mb has arrived; a backward
  B(mb) or I(mb) on a stage s < S-1 cannot start before the gradient of mb has arrived
  from stage s+1.
  RECV_ACT / RECV_GRAD block the stage until that arrival, and so does the compute itself;
* SEND_ACT / SEND_GRAD are asynchronous: they issue a transfer at the group's current time
  and never block the sender. Each ordered pair of groups that a boundary crosses has one
  link that carries one transfer at a time, first come first served in issue order (the
  boundaries of different chunks between the same two groups share it); a boundary-s
  transfer takes ``costs[s].send_ms`` in either direction. Transfers therefore overlap
  compute but not each other on the same link. A boundary between two stages of the same
  group is a local hand-off: it arrives when it is sent and uses no link;
* B (the full backward) takes ``backward_ms``; I (its input-gradient half, out-of-order
  backprop, ooo-backprop sec. 3) takes ``backward_input_ms`` and W ``backward_weight_ms``.
  The kind is the schedule builder's decision; it is drawn as a "B" block either way;
* ALLREDUCE syncs the stage's gradients in buckets (``StageCost.allreduce_buckets``, the
  buckets of ``plan.buckets``): each starts when the stage's last compute action (the last
  micro-batch's backward) has passed the bucket's layers and the previous bucket is done,
  so the backward of earlier layers hides part of the sync (DAPPLE 5.2.3, 6.3 "DP
  Overlap"); the stage ends when its last bucket does;
* a W limited to some layers (the per-layer ending phase of out-of-order schedules,
  ooo-backprop Algorithm 2) takes those layers' ``layer_weight_ms``; an ALLREDUCE limited
  to some layers is an asynchronous bucket (``schedule.ooo.ending_buckets``: one per
  ``bucket_layers`` bucket, listed in launch order after the W part completing its
  layers): it starts when the stage reaches it and the stage's previous bucket is done,
  and does not occupy the stage, whose end is then the later of its last compute and its
  last bucket. The j-th such bucket takes ``StageCost.buckets[j]``'s AllReduce time when
  the stage lists as many buckets as its cost has (the cost model's buckets, the same
  ``bucket_layers`` ranges), else its layers' ``layer_allreduce_ms``. Buckets are drawn on
  the link ``"AR<stage>"`` of ``transfers``;
* the B of a micro-batch the stage recomputes (``Schedule.recomputed``) first pays
  ``recompute_ms`` (the stage forward again, gpipe.txt 2.3);
* a tied parameter the plan splits over several stages (``StageCost.tied``) is summed by
  one more AllReduce over all of them, after each one's own list and buckets are done:
  it starts when the last of its stages gets there and ends every one of them
  (``execute/tied.py`` issues it after the stage's buckets). Ties are run in the order
  of the profile's ``tied`` list, drawn as "TAR" spans on the stages and on the link
  ``tied<index>`` of ``transfers``;
* then each group runs the optimizer step over its stages' parameters
  (``StageCost.optimizer_ms``, summed over the group's stages), drawn as an "OPT" span: the
  group's step ends when its optimizer step does;
* a schedule that lists no communication action at all is read as "implicit communication":
  each result is sent as soon as the compute producing it ends;
* results: a device's timeline is its group's (spans carry their ``stage`` where the group
  runs several), and each stage's ``StageResult`` holds its own spans and busy time, its
  group's end and its own stash walk. The bubble fraction counts every device once.
* the weight gradients of every micro-batch after a stage's first of the step add into the
  ones already there (``StageCost.accumulate_ms``, one add per layer): charged in B, or in W
  where the backward is split (a part W pays its layers' share);
* every action also costs the executor's own time (``StageCost.overhead``, measured at
  profile time): a compute action takes that much longer, a send holds the stage that long
  before its transfer is issued, and a receive holds it that long after its data arrived.

A schedule whose order can never complete (e.g. a stage waiting for a gradient whose
backward is queued behind a forward that needs this stage's own later work) raises
:class:`ScheduleDeadlock` (a ``ValueError``) naming each stuck stage and action.

The module is long because the rules above act on one shared state of the step (the
groups' clocks, the links, the arrivals), and its results are read field by field by the
planner, the command lines and the timelines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Sequence

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.costs import StageCost
from lightning_dapple.schedule.actions import Action, Kind, Schedule, stash_walk

__all__ = [
    "ScheduleDeadlock",
    "SimulationResult",
    "Span",
    "StageResult",
    "simulate",
]

_COMM_KINDS = (Kind.RECV_ACT, Kind.SEND_ACT, Kind.RECV_GRAD, Kind.SEND_GRAD)
COMPUTE_SPANS = ("F", "B", "W")  # what counts as busy (AllReduces and waits are idle)


# the kind of ``ActionOverhead`` each action pays (ALLREDUCE pays none)
_OVERHEAD_KIND = {
    Kind.F: "F", Kind.B: "B", Kind.I: "I", Kind.W: "W",
    Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send", Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv",
}


class ScheduleDeadlock(ValueError):
    """The schedule's action order can never complete (every remaining action waits)."""


class Span(NamedTuple):
    """One block of a timeline: [start_ms, end_ms) of ``kind`` on ``microbatch``.

    ``kind`` is "F", "B", "W", "AR", "TAR" (a tied parameter's AllReduce) or "OPT" (the
    optimizer step) on devices (the last three have microbatch None), and "act" or "grad"
    on links. ``stage`` names
    the stage (chunk) of a span on a device group that runs several.
    """

    start_ms: float
    end_ms: float
    kind: str
    microbatch: int | None
    # the stage a span belongs to where a device group runs several (chunks); else None
    stage: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"start_ms": self.start_ms, "end_ms": self.end_ms, "kind": self.kind, "microbatch": self.microbatch}
        if self.stage is not None:
            out["stage"] = self.stage
        return out


@dataclass(frozen=True)
class StageResult:
    """What one stage did; every device of the stage did exactly the same.

    ``peak_in_flight`` counts micro-batches whose F is done and whose backward is not: a
    micro-batch leaves the count when its B ends, or, if the stage also runs a W for it
    (split backward), when its last W ends, since W still reads the stashed activations.
    ``peak_stash_bytes`` is that count times the stash of one micro-batch slice (the
    activation term of DAPPLE 5.3's memory bound: K_i slices under early backward, M under
    GPipe); when the stage recomputes or defers W it is the peak of
    ``schedule.actions.stash_walk`` (stage input only for recomputed micro-batches, stash plus
    kept gradients while a W is pending), the rule the executor measures by.
    """

    stage: int
    devices: tuple[int, ...]
    warmup: int
    busy_ms: float
    end_ms: float
    peak_in_flight: int
    peak_stash_bytes: float
    cost: StageCost
    spans: tuple[Span, ...]

    def busy_fraction(self, latency_ms: float) -> float:
        return self.busy_ms / latency_ms if latency_ms > 0 else 0.0

    def to_dict(self, latency_ms: float) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "devices": list(self.devices),
            "warmup": self.warmup,
            "forward_ms": self.cost.forward_ms,
            "backward_ms": self.cost.backward_ms,
            "send_ms": self.cost.send_ms,
            "allreduce_ms": self.cost.allreduce_ms,
            "tied_allreduce_ms": self.cost.tied_allreduce_ms,
            "optimizer_ms": self.cost.optimizer_ms,
            "accumulate_ms": self.cost.accumulate_ms,
            "stash_bytes": self.cost.stash_bytes,
            "busy_ms": self.busy_ms,
            "busy_fraction": self.busy_fraction(latency_ms),
            "end_ms": self.end_ms,
            "peak_in_flight": self.peak_in_flight,
            "peak_stash_bytes": self.peak_stash_bytes,
        }


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of one simulated training step.

    ``bubble_fraction`` = 1 - (compute busy time summed over all devices) / (number of
    devices x latency). Only F, B and W count as busy: AllReduce and waiting for transfers
    are counted as idle, so the fraction is the share of device time not spent computing
    (GPipe's (S-1)/(M+S-1) for a balanced pipeline without communication, gpipe.txt sec. 2).
    ``timelines`` maps each global device rank to its spans in time order; ``transfers``
    maps a link ("0->1" activations, "1->0" gradients) to its transfer spans.
    """

    schedule: str
    micro_batches: int
    latency_ms: float
    bubble_fraction: float
    timelines: dict[int, list[Span]]
    stages: list[StageResult]
    transfers: dict[str, list[Span]] = field(default_factory=dict)
    # the least step the machines' shared cores allow (simulate.cores); None: not bound
    core_bound_ms: float | None = None

    @property
    def num_devices(self) -> int:
        return len(self.timelines)

    def to_dict(self, spans: bool = True) -> dict[str, Any]:
        """JSON-ready form; ``spans=False`` leaves out the (long) timelines and transfers."""
        out: dict[str, Any] = {
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "num_devices": self.num_devices,
            "latency_ms": self.latency_ms,
            "bubble_fraction": self.bubble_fraction,
            "stages": [stage.to_dict(self.latency_ms) for stage in self.stages],
        }
        if self.core_bound_ms is not None:
            out["core_bound_ms"] = self.core_bound_ms
        if spans:
            out["timelines"] = {str(device): [s.to_dict() for s in items] for device, items in self.timelines.items()}
            out["transfers"] = {link: [s.to_dict() for s in items] for link, items in self.transfers.items()}
        return out


# --------------------------------------------------------------------------- simulation


class _Link:
    """One direction of one stage boundary: a FIFO server of transfers."""

    def __init__(self, name: str, duration: float) -> None:
        self.name = name
        self.duration = duration
        self.free_at = 0.0
        self.spans: list[Span] = []

    def transfer(self, issued_at: float, kind: str, microbatch: int, duration: float | None = None, stage: int | None = None) -> float:
        start = max(issued_at, self.free_at)
        end = start + (self.duration if duration is None else duration)
        self.free_at = end
        self.spans.append(Span(start, end, kind, microbatch, stage))
        return end


class _Stage:
    """The clock of one device group: it runs the group's order strictly in order (one
    stage's list, or the merged order of the stages (chunks) the group holds)."""

    def __init__(self, index: int, actions: Sequence[Action]) -> None:
        self.index = index
        self.actions = actions
        self.pc = 0
        self.clock = 0.0
        self.spans: list[Span] = []
        self.blocked_on = ""

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.actions)


def _check_schedule(schedule: Schedule, costs: Sequence[StageCost]) -> None:
    """``DappleConfigError`` naming the first malformed action of a schedule (wrong stage,
    micro-batch out of range, listed twice, talking to a stage that does not exist)."""
    num_stages = schedule.num_stages
    require(len(schedule.actions) == num_stages, "schedule.actions", f"has {len(schedule.actions)} lists for {num_stages} stages", "give one action list per stage")
    require(len(costs) == num_stages, "costs", f"has {len(costs)} entries for {num_stages} stages", "price every stage (stage_costs(profile, cluster, plan.stages, ...))")
    for s, actions in enumerate(schedule.actions):
        found = next(_schedule_problems(s, actions, schedule.micro_batches, num_stages), None)
        if found is not None:
            action, problem, fix = found
            raise DappleConfigError(f"schedule.actions[{s}] ({action})", problem, fix)
    if schedule.orders or schedule.placement:
        _check_orders(schedule)


def _check_orders(schedule: Schedule) -> None:
    """Several stages per device group: a group of every stage, and each group's merged
    order holding exactly its stages' lists, each in its own order."""
    placement, orders = schedule.placement, schedule.orders
    require(len(placement) == schedule.num_stages, "schedule.placement", f"has {len(placement)} entries for {schedule.num_stages} stages", "give the device group of every stage")
    require(
        set(placement) == set(range(len(orders))),
        "schedule.orders",
        f"has {len(orders)} group orders but the placement uses groups {sorted(set(placement))}",
        "give one merged order per device group 0..G-1",
    )
    for group, order in enumerate(orders):
        for stage in range(schedule.num_stages):
            if placement[stage] != group:
                continue
            mine = tuple(action for action in order if action.stage == stage)
            require(
                mine == schedule.actions[stage],
                f"schedule.orders[{group}]",
                f"runs stage {stage}'s actions as {' '.join(a.text for a in mine[:12])}... but the stage lists {' '.join(a.text for a in schedule.actions[stage][:12])}...",
                "build the per-stage lists from the group orders (schedule.chunked.schedule_from_orders)",
            )
        strangers = [action for action in order if placement[action.stage] != group] if all(a.stage < len(placement) for a in order) else list(order)
        require(not strangers, f"schedule.orders[{group}]", f"holds {strangers[0] if strangers else ''}, an action of a stage on another group", "list each action in its own group's order")


def _schedule_problems(s: int, actions: Sequence[Action], micro_batches: int, num_stages: int) -> Iterator[tuple[Action, str, str]]:
    """(action, what is wrong, how to fix it) for each action of stage ``s`` that is wrong
    (the messages are built only for those: a long schedule has tens of thousands of actions)."""
    seen_buckets: set[tuple[int, int] | None] = set()
    seen: set[tuple[Kind, int | None, tuple[int, int] | None]] = set()
    weight = {a.microbatch for a in actions if a.kind is Kind.W}
    input_only = {a.microbatch for a in actions if a.kind is Kind.I}
    backward: set[int | None] = set()
    for action in actions:
        if action.stage != s:
            yield action, f"belongs to stage {action.stage}", "put each action in its own stage's list"
        if action.kind is Kind.ALLREDUCE:
            if action.layers in seen_buckets:
                yield action, "appears twice", "list each AllReduce bucket once"
            seen_buckets.add(action.layers)
            continue
        if action.microbatch is None or not 0 <= action.microbatch < micro_batches:
            yield action, f"names micro-batch {action.microbatch!r} but M = {micro_batches}", "use micro-batch ids 0..M-1"
        key = (action.kind, action.microbatch, action.layers)
        if key in seen:
            yield action, "appears twice", "list each action once per stage"
        seen.add(key)
        yield from _backward_problems(action, weight, input_only, backward)
        no_prev = s == 0 and action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD)
        no_next = s == num_stages - 1 and action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
        if no_prev or no_next:
            yield action, "has no neighbouring stage to talk to", "drop it from the first/last stage's list"


def _backward_problems(
    action: Action, weight: set[int | None], input_only: set[int | None], backward: set[int | None]
) -> Iterator[tuple[Action, str, str]]:
    """An I needs W actions for its weight gradients, a W an I before it; one backward per
    micro-batch (``backward`` collects the micro-batches seen so far)."""
    mb = action.microbatch
    if action.kind.is_backward:
        if mb in backward:
            yield action, f"is a second backward of micro-batch {mb}", "give each micro-batch one B or one I"
        backward.add(mb)
    if action.kind is Kind.I and mb not in weight:
        yield action, f"leaves the weight gradients of micro-batch {mb} to W actions the stage does not list", f"list W{mb} after it, or make it a full backward B"
    if action.kind is Kind.W and mb not in input_only:
        yield action, f"computes weight gradients that the backward of micro-batch {mb} already computed", f"make that backward I{mb} (input gradients only) or drop the W"


def simulate(
    schedule: Schedule,
    costs: Sequence[StageCost],
    devices: Sequence[Sequence[int]] | None = None,
) -> SimulationResult:
    """Run ``schedule`` with per-stage ``costs``; ``devices[s]`` are stage s's global ranks.

    Without ``devices`` device group g is the single device g. Raises ``ScheduleDeadlock``
    when the action order can never complete and ``DappleConfigError`` for a malformed
    schedule.
    """
    _check_schedule(schedule, costs)
    groups = _device_groups(schedule, devices)
    run = _Run(schedule, costs)
    run.to_fixpoint()
    return run.result(groups)


def _device_groups(schedule: Schedule, devices: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """Each stage's devices; the stages of one device group list the same ones."""
    num_stages = schedule.num_stages
    if devices is None:
        devices = [(schedule.group_of(s),) for s in range(num_stages)]
    groups = [tuple(int(d) for d in group) for group in devices]
    require(len(groups) == num_stages, "devices", f"has {len(groups)} groups for {num_stages} stages", "give one device list per stage")
    require(all(groups), "devices", "has an empty group", "give every stage at least one device")
    by_group: dict[int, tuple[int, ...]] = {}
    for s, group in enumerate(groups):
        require(
            by_group.setdefault(schedule.group_of(s), group) == group,
            "devices",
            f"gives stage {s} devices {list(group)} but its device group runs on {list(by_group[schedule.group_of(s)])}",
            "give the stages of one device group the same devices",
        )
    flat = [d for group in by_group.values() for d in group]
    require(len(flat) == len(set(flat)), "devices", "lists a device in two stages", "give each device to one stage")
    return groups


# the stage's own action an action needs to have run first
_NEEDS = {
    Kind.B: (Kind.F,),
    Kind.I: (Kind.F,),
    Kind.W: (Kind.I,),
    Kind.SEND_ACT: (Kind.F,),
    Kind.SEND_GRAD: (Kind.B, Kind.I),
}


class _Run:
    """The state of one simulation: group clocks, links and arrival times (module docstring)."""

    def __init__(self, schedule: Schedule, costs: Sequence[StageCost]) -> None:
        self.schedule = schedule
        self.costs = costs
        n = self.num_stages = schedule.num_stages
        self.group = [schedule.group_of(s) for s in range(n)]
        self.chunked = bool(schedule.orders)
        kinds = [{a.kind for a in acts} for acts in schedule.actions]  # the kinds each stage lists
        self.implicit = not any(kind in listed for listed in kinds for kind in _COMM_KINDS)
        self.stages = [_Stage(g, schedule.group_actions(g)) for g in range(schedule.num_groups)]
        self.done: list[dict[tuple[Kind, int], float]] = [{} for _ in range(n)]  # per stage: compute (kind, mb) -> end
        self.links = self._links()
        # arrival time at stage s of the activation (from s-1) / gradient (from s+1) of mb
        self.act_arrival: list[dict[int, float]] = [{} for _ in range(n)]
        self.grad_arrival: list[dict[int, float]] = [{} for _ in range(n)]
        self.recomputed = [schedule.recomputed(s) for s in range(n)]
        self.w_parts = [_w_part_counts(schedule.actions[s]) for s in range(n)]
        self.bucket_parts = [sum(1 for a in schedule.actions[s] if a.kind is Kind.ALLREDUCE and a.layers is not None) for s in range(n)]
        self.bucket_links = [_Link(f"AR{s}", 0.0) for s in range(n)]
        self.buckets_seen = [0] * n
        self.own = [_own_ms(schedule, s, costs[s]) for s in range(n)]
        # per stage: the micro-batch whose weight gradients came first this step (later ones accumulate)
        self.first_weights: list[int | None] = [None] * n

    def _links(self) -> dict[tuple[int, int], _Link]:
        """One link per direction per pair of device groups that a boundary crosses
        (activations of every boundary first, then gradients, in boundary order); a
        boundary inside a group uses none."""
        links: dict[tuple[int, int], _Link] = {}
        pairs = [(self.group[s], self.group[s + 1]) for s in range(self.num_stages - 1)]
        for a, b in [*pairs, *((b, a) for a, b in pairs)]:
            if a != b and (a, b) not in links:
                links[(a, b)] = _Link(f"{a}->{b}", 0.0)
        return links

    def transfer(self, sender: int, receiver: int, boundary: int, kind: str, mb: int, at: float) -> float:
        """Arrival time at ``receiver`` of a tensor ``sender`` sends at ``at`` over ``boundary``."""
        a, b = self.group[sender], self.group[receiver]
        if a == b:
            return at
        label = sender if self.chunked else None
        return self.links[(a, b)].transfer(at, kind, mb, self.costs[boundary].send_ms, label)

    def send_act(self, s: int, mb: int, at: float) -> None:
        self.act_arrival[s + 1][mb] = self.transfer(s, s + 1, s, "act", mb, at)

    def send_grad(self, s: int, mb: int, at: float) -> None:
        self.grad_arrival[s - 1][mb] = self.transfer(s, s - 1, s - 1, "grad", mb, at)

    def compute(self, st: _Stage, action: Action, mb: int, duration: float, ready: float) -> None:
        start = max(st.clock, ready)
        st.clock = start + duration
        self.done[action.stage][(action.kind, mb)] = st.clock
        st.spans.append(Span(start, st.clock, action.kind.block, mb, action.stage if self.chunked else None))

    def accumulates(self, s: int, mb: int) -> bool:
        """Whether the weight gradients of ``mb`` on stage ``s`` add into earlier ones: every
        micro-batch's but the first to compute them this step (``LayerProfile.accumulate_ms``;
        charged where the weight gradients are made: in B, or in W where the backward is split)."""
        first = self.first_weights[s]
        if first is None:
            self.first_weights[s] = mb
            return False
        return first != mb

    def accumulation(self, s: int, mb: int) -> float:
        """The stage's whole accumulation where ``mb`` accumulates (``accumulates``), else 0."""
        return self.costs[s].accumulate_ms if self.accumulates(s, mb) else 0.0

    @staticmethod
    def part_ms(per_layer: tuple[float, ...], whole: float, layers: tuple[int, int], parts: int) -> float:
        if per_layer and layers[1] <= len(per_layer):
            return float(sum(per_layer[layers[0] : layers[1]]))
        return whole / max(parts, 1)

    def allreduce(self, st: _Stage, action: Action) -> None:
        """A layer-limited ALLREDUCE is an asynchronous bucket; a whole-stage one runs the
        stage's overlapped buckets and holds the group until the last ends."""
        s, cost = action.stage, self.costs[action.stage]
        link = self.bucket_links[s]
        if action.layers is None:
            st.clock = _overlapped_allreduce(st, cost, link, s if self.chunked else None)
            return
        link.duration = self.bucket_ms(s, action.layers)
        if link.duration > 0:
            link.transfer(st.clock, "AR", None)  # type: ignore[arg-type]

    def bucket_ms(self, s: int, layers: tuple[int, int]) -> float:
        """AllReduce time of the stage's next layer-limited bucket (module docstring)."""
        cost, index = self.costs[s], self.buckets_seen[s]
        self.buckets_seen[s] += 1
        if len(cost.buckets) == self.bucket_parts[s]:
            return cost.buckets[index][1]
        return self.part_ms(cost.layer_allreduce_ms, cost.allreduce_ms, layers, self.bucket_parts[s])

    def arrival(self, st: _Stage, action: Action, mb: int) -> float | None:
        """When the input ``action`` waits for has arrived (0 if none), None if not yet known."""
        s, kind = action.stage, action.kind
        if kind in (Kind.RECV_ACT, Kind.F) and s > 0:
            if mb not in self.act_arrival[s]:
                st.blocked_on = f"the activation of micro-batch {mb} from stage {s - 1}"
                return None
            return self.act_arrival[s][mb]
        if (kind is Kind.RECV_GRAD or kind.is_backward) and s < self.num_stages - 1:
            if mb not in self.grad_arrival[s]:
                st.blocked_on = f"the gradient of micro-batch {mb} from stage {s + 1}"
                return None
            return self.grad_arrival[s][mb]
        return 0.0

    def step(self, st: _Stage, action: Action) -> bool:
        """Execute ``action`` if its inputs are known; else record why not and return False."""
        s, kind, mb = action.stage, action.kind, action.microbatch
        if kind is Kind.ALLREDUCE:
            self.allreduce(st, action)
            return True
        assert mb is not None
        arrival = self.arrival(st, action, mb)
        if arrival is None:
            return False
        needs = _NEEDS.get(kind)
        if needs is not None and not any((need, mb) in self.done[s] for need in needs):
            st.blocked_on = f"its own {' or '.join(f'{need.value}{mb}' for need in needs)}, which is not before it in stage {s}'s list"
            return False
        self.execute(st, action, mb, arrival)
        return True

    def execute(self, st: _Stage, action: Action, mb: int, arrival: float) -> None:
        """Run one non-AllReduce action whose inputs are there; each pays its kind's
        overhead (``StageCost.overhead``) on top of its compute or before its transfer."""
        s, kind, cost = action.stage, action.kind, self.costs[action.stage]
        own = self.own[s][kind]
        if kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            st.clock = max(st.clock, arrival) + own
        elif kind is Kind.F:
            self.compute(st, action, mb, cost.forward_ms + own, arrival)
            if self.implicit and s < self.num_stages - 1:
                self.send_act(s, mb, st.clock)
        elif kind.is_backward:
            extra = cost.recompute_ms if mb in self.recomputed[s] else 0.0
            extra += self.accumulation(s, mb) if kind is Kind.B else 0.0
            self.compute(st, action, mb, (cost.backward_input_ms if kind is Kind.I else cost.backward_ms) + extra + own, arrival)
            if self.implicit and s > 0:
                self.send_grad(s, mb, st.clock)
        elif kind is Kind.W and action.layers is not None:
            parts = self.w_parts[s].get(mb, 1)
            accumulate = self.part_ms(cost.layer_accumulate_ms, cost.accumulate_ms, action.layers, parts) if self.accumulates(s, mb) else 0.0
            self.compute(st, action, mb, self.part_ms(cost.layer_weight_ms, cost.backward_weight_ms, action.layers, parts) + accumulate + own, 0.0)
        elif kind is Kind.W:
            self.compute(st, action, mb, cost.backward_weight_ms + self.accumulation(s, mb) + own, 0.0)
        elif kind is Kind.SEND_ACT:
            st.clock += own
            self.send_act(s, mb, st.clock)
        elif kind is Kind.SEND_GRAD:
            st.clock += own
            self.send_grad(s, mb, st.clock)

    def to_fixpoint(self) -> None:
        """Dataflow fixpoint: every action's times depend only on earlier actions of its own
        group and on transfers whose issue order is fixed by the sender's list, so running
        each group as far as it can, round after round, yields the exact event times. The
        rounds alternate between the pipeline's two directions, the ways activations and
        gradients travel, so that fewer are needed; the order changes no time, and the last
        round, in which no group moves, leaves each stuck group's reason as of the end."""
        progress = True
        step = self.step
        order = self.stages
        while progress:
            progress = False
            for st in order:
                actions, pc = st.actions, st.pc
                end = len(actions)
                while pc < end and step(st, actions[pc]):
                    pc += 1
                if pc != st.pc:
                    st.pc = pc  # a group stuck for good keeps the reason its last step gave
                    progress = True
            order = order[::-1]
        stuck = [st for st in self.stages if not st.finished]
        if stuck:
            where = "device group" if self.chunked else "stage"
            detail = "; ".join(f"{where} {st.index} is stuck at {st.actions[st.pc]} waiting for {st.blocked_on}" for st in stuck)
            first = stuck[0]
            raise ScheduleDeadlock(
                f"schedule {self.schedule.name!r} deadlocks at {where} {first.index}, action {first.actions[first.pc]}: {detail}. "
                "Fix: order each stage's actions so every wait can be met (under DAPPLE the warm-up counts must not grow "
                "along the pipeline, K_i >= K_(i+1))"
            )

    def stage_result(self, s: int, end: float, devices: tuple[int, ...]) -> StageResult:
        """Stage ``s``'s part of its group's timeline (all of it with one stage per group)."""
        cost = self.costs[s]
        spans = [span for span in self.stages[self.group[s]].spans if span.stage in (None, s)]
        busy = sum(span.end_ms - span.start_ms for span in spans if span.kind in COMPUTE_SPANS)
        actions = self.schedule.actions[s]
        recomputed = self.recomputed[s]
        stash, peak = stash_walk([a for a in actions if a.kind.is_compute], recomputed, cost.stash_bytes, cost.input_bytes, cost.wgrad_bytes)
        if not recomputed and not any(a.kind is Kind.W for a in actions):
            stash = peak * cost.stash_bytes  # the plain rule: K_i (or M) slices
        warmups = self.schedule.warmups
        return StageResult(
            stage=s,
            devices=devices,
            warmup=warmups[s] if s < len(warmups) else 0,
            busy_ms=busy,
            end_ms=end,
            peak_in_flight=peak,
            peak_stash_bytes=stash,
            cost=cost,
            spans=tuple(spans),
        )

    def tied_allreduces(self, ends: list[float]) -> dict[str, list[Span]]:
        """Run the tied parameters' AllReduces after the groups' ends (module docstring);
        moves those ends (per group) and returns each tie's link spans."""
        holders: dict[int, list[int]] = {}
        durations: dict[int, float] = {}
        for s, cost in enumerate(self.costs):
            for tie, duration in cost.tied:
                holders.setdefault(tie, []).append(self.group[s])
                durations[tie] = duration
        links: dict[str, list[Span]] = {}
        for tie in sorted(holders):
            groups = sorted(set(holders[tie]))
            start = max(ends[g] for g in groups)
            end = start + durations[tie]
            if end <= start:
                continue
            span = Span(start, end, "TAR", None)
            links[f"tied{tie}"] = [span]
            for g in groups:
                self.stages[g].spans.append(span)
                ends[g] = end
        return links

    def optimizer_steps(self, ends: list[float]) -> None:
        """Each group's optimizer step after its gradient sync (module docstring); moves its end."""
        steps: dict[int, float] = {}
        for s, cost in enumerate(self.costs):
            steps[self.group[s]] = steps.get(self.group[s], 0.0) + cost.optimizer_ms
        for g, duration in steps.items():
            if duration > 0:
                self.stages[g].spans.append(Span(ends[g], ends[g] + duration, "OPT", None))
                ends[g] += duration

    def result(self, devices: list[tuple[int, ...]]) -> SimulationResult:
        ends = [st.clock for st in self.stages]
        for s, link in enumerate(self.bucket_links):
            ends[self.group[s]] = max(ends[self.group[s]], link.free_at)
        tied_links = self.tied_allreduces(ends)
        self.optimizer_steps(ends)
        latency = max(ends, default=0.0)
        results = [self.stage_result(s, ends[self.group[s]], devices[s]) for s in range(self.num_stages)]
        timelines: dict[int, list[Span]] = {}
        for s, stage in enumerate(results):
            for device in stage.devices:
                timelines[device] = list(self.stages[self.group[s]].spans)
        busy_total = sum(stage.busy_ms * len(stage.devices) for stage in results)
        flat = len(timelines)
        bubble = 1.0 - busy_total / (flat * latency) if latency > 0 else 0.0
        transfers = {link.name: link.spans for link in self.links.values()}
        transfers.update({link.name: link.spans for link in self.bucket_links if link.spans})
        transfers.update(tied_links)
        return SimulationResult(
            schedule=self.schedule.name,
            micro_batches=self.schedule.micro_batches,
            latency_ms=latency,
            bubble_fraction=bubble,
            timelines=dict(sorted(timelines.items())),
            stages=results,
            transfers=transfers,
        )


def _overlapped_allreduce(st: _Stage, cost: StageCost, link: _Link, stage: int | None = None) -> float:
    """Run the stage's gradient buckets (``cost.allreduce_buckets``) on its link and return
    when the last one ends (the stage's step waits for all of them).

    A bucket is ready when the backward of its layers is done in the stage's last compute
    action: that action's end minus the backward still to run after the bucket, but not
    before the action starts. Buckets take the link one after another in launch order
    (torch DDP's reducer). The whole sync is drawn as one "AR" span on the stage from the
    first bucket's start to the last one's end, each bucket on the link ``AR<stage>``.
    """
    last = next((span for span in reversed(st.spans) if span.kind in ("B", "W") and span.stage in (None, stage)), None)
    end = st.clock
    for remaining, duration in cost.allreduce_buckets:
        if duration <= 0:
            continue
        ready = end - remaining if last is None else max(last.start_ms, last.end_ms - remaining)
        start = max(ready, link.free_at)
        link.free_at = start + duration
        link.spans.append(Span(start, link.free_at, "AR", None))
    finish = max(end, link.free_at)
    if finish > end:
        st.spans.append(Span(end, finish, "AR", None, stage))
    return finish


def _own_ms(schedule: Schedule, s: int, cost: StageCost) -> dict[Kind, float]:
    """The executor's own time of each action kind of stage ``s`` (``StageCost.overhead``);
    a transfer to or from a stage of the same device group is handed over in-process and
    pays no transport overhead."""
    own = {kind: cost.overhead.of(key) for kind, key in _OVERHEAD_KIND.items()}
    for kind in _COMM_KINDS:
        peer = s + 1 if kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else s - 1
        if 0 <= peer < schedule.num_stages and schedule.group_of(peer) == schedule.group_of(s):
            own[kind] = 0.0
    return own


def _w_part_counts(actions: Sequence[Action]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for action in actions:
        if action.kind is Kind.W and action.layers is not None and action.microbatch is not None:
            counts[action.microbatch] = counts.get(action.microbatch, 0) + 1
    return counts
