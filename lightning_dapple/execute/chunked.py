"""One rank running several stages (chunks): Megatron's interleaved placement and ZB-V's V.

A plan may put several stages on the same devices (``Plan.device_groups``); the schedule
then gives each device group one merged order of its stages' actions
(``Schedule.group_actions``), each stage's actions keeping their order in
``Schedule.actions[stage]``. This rank runs that order.

Why one runner per stage, driven by a ``ChunkedRunner``, rather than one runner that knows
about chunks: everything a stage keeps between its actions -- its ``Stage`` (layers and each
micro-batch's autograd state, keyed by micro-batch), its gradient buckets, its BatchNorm
buffers, its W spans and recomputed micro-batches -- is the same per chunk as for a lone
stage, and micro-batch numbers repeat across chunks, so each chunk needs exactly that state
of its own. The ``StageRunner`` of each chunk compiles its own list once, as for any plan;
what the rank has once is shared (``RankShared``): the one ``Transport`` (its messages
tagged per boundary and direction, each such stream in one order at both ends:
``links.check_stream_orders``), the one
``ResultChannel`` (the loss comes from the last stage wherever it is placed: the last
group under interleaving, group 0 under ZB-V), the one stash ledger (the rank's peak counts
every chunk's stash, keyed (stage, micro-batch)) and the hand-offs. The ``ChunkedRunner``
then strings the chunks' compiled ops together in the merged order, once, in set-up (with
the receives posted one transfer ahead where that pays, ``transport.receives_ahead_pay``): a
step only runs that list. Each send is waited at the first receive of the merged order by
which its receiver is known to have it (``schedule.settle.group_settle_points``, derived
from every group's merged order: one stage's list would not show the other chunks' work
between a peer's send and its next receive), so its buffer is freed there and not at the
end of the step; ``chunk_settle_points`` hands each chunk its share of those points.

A boundary between two stages on the same devices (ZB-V's turn, stage P-1 to P) is a
hand-off inside the process (``Handoffs``): the stage output goes over cut from the
sender's graph, as it would arrive from a wire, so each stage's backward stops at its own
input, and its gradient comes back the same way. The schedule still lists both actions, so
each stage's list reads as it would across devices.

Gradients of chunks on the same replicas are summed over the one replica group
(``groups.build_groups``); every replica runs the same merged order, so the buckets of all
chunks are launched in the same order on each. Stages on the same devices have the same
replica count, so gradient clipping's per-rank share stays ``1 / replicas``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
from torch import nn

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.failure import PeerFailedError
from lightning_dapple.execute.transfer.keys import TransferKey, transfer_key
from lightning_dapple.execute.replay import restore_rng, save_rng, step_key
from lightning_dapple.execute.results import ResultChannel
from lightning_dapple.execute.slicing import batch_size_of
from lightning_dapple.execute.spans import span_clock
from lightning_dapple.execute.stash_ledger import StashLedger
from lightning_dapple.execute.stats import StageStats
from lightning_dapple.execute.tied import TiedSync
from lightning_dapple.execute.transfer.transport import Transport
from lightning_dapple.plan.plan import Plan
from lightning_dapple.schedule.actions import Action, Schedule
from lightning_dapple.schedule.settle import group_settle_points

__all__ = ["ChunkedRunner", "RankShared", "Handoffs", "chunk_settle_points"]

# per stage of a rank: position in the stage's own list of a receive -> the sends it waits for
ChunkSettle = Mapping[int, Mapping[int, frozenset[TransferKey]]]


def chunk_settle_points(schedule: Schedule, group: int) -> dict[int, dict[int, frozenset[TransferKey]]]:
    """``group_settle_points`` of device ``group``, per stage of the group: the position of
    each such receive in its stage's own list (what that stage's runner compiles) -> the
    transfer keys of the sends, of any of the group's stages, it waits for."""
    points = group_settle_points(schedule)[group]
    out: dict[int, dict[int, frozenset[TransferKey]]] = {}
    cursor: dict[int, int] = {}
    for index, action in enumerate(schedule.group_actions(group)):
        position = cursor.get(action.stage, 0)
        cursor[action.stage] = position + 1
        if index in points:
            keys = frozenset(transfer_key(kind, stage, mb) for kind, stage, mb in points[index])
            out.setdefault(action.stage, {})[position] = keys
    return out


class Handoffs:
    """Boundary tensors between two stages on this rank's own devices, by transfer key."""

    def __init__(self) -> None:
        self._held: dict[Hashable, Any] = {}

    def put(self, key: Hashable, value: Any) -> None:
        self._held[key] = value

    def take(self, key: Hashable) -> Any:
        if key not in self._held:
            raise RuntimeError(f"{key} of a stage on the same ranks was taken before it was handed over: the merged order runs a receive before its send")
        return self._held.pop(key)

    def clear(self) -> None:
        """A new step (or one after a failure): nothing is held."""
        self._held.clear()


@dataclass
class RankShared:
    """What the chunks of one rank share; ``stage``: the chunk a copy is given to."""

    transport: Transport
    results: ResultChannel
    ledger: StashLedger
    handoffs: Handoffs = field(default_factory=Handoffs)
    stage: int = -1
    settle: ChunkSettle = field(default_factory=dict)  # ``chunk_settle_points`` (empty: all at the end)

    def of_stage(self, stage: int) -> "RankShared":
        return replace(self, stage=stage)


class ChunkedRunner:
    """Runs this rank's stages in its device group's merged order, one ``StageRunner`` each.

    The public face is ``StageRunner``'s (``train_step``, ``forward_step``, ``parameters``,
    ``stats``, ``finish``, ...), so callers hold either. ``units`` are the rank's stage
    runners in pipeline order, built with ``shared.of_stage(stage)`` (``StageRunner.for_plan``
    builds them; typed loosely here because ``runner.py`` imports this module).
    """

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        rank: int,
        units: Sequence[Any],
        shared: RankShared,
        tied: TiedSync | None,
        post_ahead: bool = False,
    ) -> None:
        self.plan = plan
        self.schedule = schedule
        self.rank = rank
        self.units = list(units)
        self.stages = tuple(unit.stage for unit in self.units)
        self.transport = shared.transport
        self.results = shared.results
        self.ledger = shared.ledger
        self.handoffs = shared.handoffs
        self.tied = tied
        self.device: torch.device = self.units[0].device
        self.is_first = self.units[0].is_first
        self.is_last = self.units[-1].is_last
        self.layers: list[nn.Module] = [layer for unit in self.units for layer in unit.layers]
        self.parameters: list[nn.Parameter] = self._trainable()
        self.stats = StageStats()
        self.steps_done = 0  # training steps run so far (part of every dropout seed; a resume sets it)
        self.job_seed: int | None = None  # as StageRunner's
        self.evals_done = 0  # as StageRunner's
        self.post_ahead = post_ahead
        self._program = self._compile()

    def _trainable(self) -> list[nn.Parameter]:
        return list({id(p): p for unit in self.units for p in unit.parameters}.values())

    def refresh_trainable(self) -> bool:
        """``StageRunner.refresh_trainable`` for every chunk, and the rank's union of them."""
        changed = [unit.refresh_trainable() for unit in self.units]
        if any(changed):
            self.parameters = self._trainable()
        return any(changed)

    def _compile(self) -> list[tuple[Any, Any]]:
        """The chunks' ops in the group's merged order, each with the runner that owns it;
        with ``post_ahead``, before each compute the receive of the next receive action of
        the merged order is posted (one transfer ahead, as ``StageRunner`` does for one
        stage: each tagged stream's receives are then still posted in its order)."""
        steps = self._merged_steps()
        receives = [index for index, (action, unit, position) in enumerate(steps) if unit.post_ahead_op(position) is not None]
        program: list[tuple[Any, Any]] = []
        ops = {unit.stage: unit.ops_by_position() for unit in self.units}
        upcoming = 0  # index into receives of the first receive after the current step
        for index, (action, unit, position) in enumerate(steps):
            while upcoming < len(receives) and receives[upcoming] <= index:
                upcoming += 1
            if self.post_ahead and action.kind.is_compute and upcoming < len(receives):
                _, owner, at = steps[receives[upcoming]]
                program.append((owner.post_ahead_op(at), owner))
            program.extend((op, unit) for op in ops[action.stage].get(position, ()))
        return program

    def _merged_steps(self) -> list[tuple[Action, Any, int]]:
        """The group's merged order as (action, the runner of its stage, its position in
        that stage's list), checked to interleave the stages' lists, each in its order."""
        group = self.plan.placement[self.stages[0]]
        units = {unit.stage: unit for unit in self.units}
        cursor = dict.fromkeys(units, 0)
        steps: list[tuple[Action, Any, int]] = []
        for action in self.schedule.group_actions(group):
            unit = units.get(action.stage)
            position = cursor.get(action.stage, 0)
            listed = unit.actions[position] if unit is not None and position < len(unit.actions) else None
            if listed != action:
                raise DappleConfigError(
                    f"schedule {self.schedule.name!r}",
                    f"the merged order of device group {group} runs {action} where stage {action.stage}'s own list has {listed}",
                    "give each group an order that interleaves its stages' lists, each kept in its order",
                )
            cursor[action.stage] = position + 1
            steps.append((action, unit, position))
        for stage, unit in units.items():
            if cursor[stage] != len(unit.actions):
                raise DappleConfigError(
                    f"schedule {self.schedule.name!r}",
                    f"the merged order of device group {group} runs {cursor[stage]} of stage {stage}'s {len(unit.actions)} actions",
                    "list every action of every stage of the group in its merged order",
                )
        return steps

    # -- training ----------------------------------------------------------------
    def train_step(self, batch: Any, callbacks: Any, extras: Callable[[], Any] | None = None) -> tuple[torch.Tensor, list[Any]]:
        """``StageRunner.train_step`` over every chunk of this rank: one step of the merged order."""
        started = time.perf_counter()
        batch_rows = batch_size_of(batch)
        self.units[0].check_batch(batch_rows)
        self.stats = stats = StageStats(spans=span_clock(self.device))
        self.ledger.start()
        stats.stash_bytes = self.ledger.stash_bytes
        self.handoffs.clear()
        self.results.post()
        rng = save_rng(self.device)  # every F reseeds; the caller's RNG stream is put back when the step ends
        seed = step_key(self.job_seed, self.steps_done)  # read before any reseed
        for unit in self.units:
            unit.begin_step(batch, batch_rows, callbacks, seed, stats)
        losses: list[torch.Tensor] = []
        try:
            self._run_program()
            self.transport.flush()
            for unit in self.units:
                unit.finish_sync()
            if self.tied is not None:
                self.tied.finish()
            for unit in self.units:
                unit.buffers.end_step()
        finally:
            restore_rng(rng)
            for unit in self.units:
                losses += unit.pipeline_stage.end_step()
            stats.peak_stash_bytes = self.ledger.peak_stash_bytes
            stats.peak_in_flight = self.ledger.peak_in_flight
            self.steps_done += 1
        for unit in self.units:
            unit.finish_sizes()
        loss_sum = torch.stack(losses).to(torch.float64).sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        loss, shared = self.results.share(loss_sum, extras() if (extras is not None and self.is_last) else None)
        assert loss is not None
        stats.step_s = time.perf_counter() - started
        return loss, shared

    def _run_program(self) -> None:
        """Run the merged ops; an error is renamed after the action it happened in."""
        op: Any = None
        unit: Any = None
        try:
            for op, unit in self._program:
                op.run(op)
        except PeerFailedError:
            raise
        except Exception as exc:
            if unit is not None:
                unit.name_failure(exc, op)
            raise

    # -- forward only (validation, test, predict) -------------------------------
    def forward_step(self, batch: Any, callbacks: Any) -> list[Any]:
        """Every chunk's forward of every micro-batch, chunks in pipeline order: data only
        flows downstream, so no rank waits for one that waits for it."""
        batch_rows = batch_size_of(batch)
        count = self.units[0].eval_micro_batches(batch_rows)
        self.handoffs.clear()
        self.results.post()
        results: list[Any] = []
        rng = save_rng(self.device)  # as StageRunner.forward_step
        try:
            self.evals_done += 1
            key = step_key(self.job_seed, self.steps_done, self.evals_done)  # one key for the batch on every chunk
            for unit in self.units:
                results = unit.eval_pass(batch, batch_rows, callbacks, count, key)
        finally:
            restore_rng(rng)
        self.transport.flush()
        return self.units[-1].gather_eval(results if self.is_last else None, count)

    def finish(self) -> None:
        """Wait for every send still pending (see ``StageRunner.finish``)."""
        self.transport.flush()
        self.results.flush()

    def share_extras(self, obj: Any) -> list[Any]:
        return self.results.share(None, obj)[1]
