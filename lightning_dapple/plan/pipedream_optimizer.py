"""PipeDream's partitioning optimizer (PipeDream 3.1) over antichain states, level by level.

The objective is the time of the slowest stage per minibatch. With ``T(k, j)`` the
compute time of the states after k up to j, ``P(k, j)`` their parameter bytes and ``B``
the level's bandwidth, PipeDream's public optimizer (which fixes details the paper leaves
open) computes, for m machines:

    single(i, j, m) = (T(i, j) + 4 (m-1) P(i, j) / (B m) / w) / m
    A(i, j, m)      = min( single(i, j, m),
                           min_{k, m'} max( A(i, k, m - m'), (T(k, j) + 4 (m'-1) P(k, j) / (B m')) / m' ) )

over states k that precede j (and do not precede the stage's start), m' = 1 .. m-1, where
``w`` is the number of devices in one machine of the level below (1 at the lowest level).
Data-parallel communication is ``4 (m-1)/m`` of the parameter bytes (push and pull through
parameter servers); activations between stages are not charged (PipeDream charges them only
under activation compression). On a hierarchical cluster the lowest level solves the
problem inside one machine for every state range, and the next level treats a machine as
a device whose compute time for a range is that best in-machine pipeline's time.

Among equally fast choices PipeDream keeps the first one its loops meet, in an order that
follows a Python set of states (so, in effect, arbitrary); here ties go to the fewest
replicas for the last stage, then to the earliest split.

The optimizer reports the chosen stages (state ranges, machines per stage), its predicted
time per minibatch and the data-parallel time under the same model, whose ratio is the
speed-up over DP that PipeDream prints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dapple.plan.pipedream_states import PipeDreamStates

__all__ = ["Level", "PipeDreamChoice", "optimize", "data_parallel_time"]

_INF = float("inf")


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``machines`` units joined at ``bandwidth`` bytes/ms."""

    machines: int
    bandwidth: float


@dataclass(frozen=True)
class PipeDreamChoice:
    """Stages as (first state row, end state, units per level, enclosing stage per level),
    levels lowest first; the predicted time per minibatch; the data-parallel time under the
    same model."""

    stages: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...]], ...]
    pipeline_ms: float
    data_parallel_ms: float

    @property
    def speedup_over_dp(self) -> float:
        return self.data_parallel_ms / self.pipeline_ms


class _Table:
    """A(r, j, m) of one level: rows r (0: from the start; r >= 1: after state r - 1)."""

    def __init__(self, rows: Sequence[int], count: int, machines: int) -> None:
        self.rows = list(rows)
        self.time = np.full((len(self.rows), count, machines + 1), _INF)
        self.split = np.full((len(self.rows), count, machines + 1), -1, dtype=int)
        self.last = np.zeros((len(self.rows), count, machines + 1), dtype=int)


def _solve_level(
    states: PipeDreamStates, compute: np.ndarray, level: Level, within: int, rows: Sequence[int], memory: float | None, straight: bool = False
) -> _Table:
    """PipeDream's recurrence for one level; ``compute[r, j]`` the time of states
    (r - 1, j] on one unit (inf where undefined). ``straight``: one unit per stage
    (PipeDream's ``--straight_pipeline``). With ``memory`` (bytes), a stage whose
    stash estimate exceeds it is not allowed (PipeDream's ``--use_memory_constraint``)."""
    count, machines, bw = states.count, level.machines, level.bandwidth
    params = _range_table(states.param_bytes)
    held = params + _range_table(states.activation_bytes)  # activations + weights of a range
    table = _Table(rows, count, machines)
    row_index = np.asarray(table.rows)
    before = np.zeros((len(row_index), count), dtype=bool)  # states preceding each row's start
    before[row_index > 0] = states.ancestors[row_index[row_index > 0] - 1] | np.eye(count, dtype=bool)[row_index[row_index > 0] - 1]
    for m in range(1, machines + 1):
        sync = 4.0 * (m - 1) * params[row_index] / (bw * m) / within if m > 1 else 0.0
        table.time[:, :, m] = (compute[row_index] + sync) / m if not (straight and m > 1) else _INF
        factor = math.ceil((machines - m) / m)
        if memory is not None and factor > 0:
            table.time[:, :, m] = np.where(factor * held[row_index] > memory, _INF, table.time[:, :, m])
    rows_at = np.arange(len(row_index))
    for j in range(count):
        ks = np.nonzero(states.ancestors[j])[0]
        if ks.size == 0:
            continue
        allowed = ~before[:, ks]  # [r, k]
        replicas = np.arange(1, machines + 1)
        sync = np.where(replicas > 1, 4.0 * (replicas - 1)[None, :] * params[ks + 1, j][:, None] / (bw * replicas), 0.0)
        last = (compute[ks + 1, j][:, None] + sync) / replicas  # [k, m'-1]
        for m in range(2, machines + 1):
            mm = np.arange(1, 2 if straight else m)
            tail = last[:, mm - 1]  # [k, m']
            if memory is not None:
                factor = np.ceil((machines - m) / mm)
                over = (factor > 0) & (held[ks + 1, j][:, None] * np.where(factor > 0, factor, 1.0) > memory)
                tail = np.where(over, _INF, tail)
            head = table.time[:, ks][:, :, m - mm]  # [r, k, m']
            cand = np.where(allowed[:, :, None], np.maximum(head, tail[None, :, :]), _INF)
            cand = cand.transpose(0, 2, 1).reshape(len(row_index), -1)  # [r, (m', k)]
            pick = np.argmin(cand, axis=1)  # ties: fewest replicas for the last stage, then the earliest split
            value = cand[rows_at, pick]
            better = value < table.time[:, j, m]
            table.time[:, j, m] = np.where(better, value, table.time[:, j, m])
            table.split[:, j, m] = np.where(better, ks[pick % ks.size], table.split[:, j, m])
            table.last[:, j, m] = np.where(better, mm[pick // ks.size], table.last[:, j, m])
    return table


def _range_table(cumulative: np.ndarray) -> np.ndarray:
    """[r, j] = value of states (r - 1, j]: cumulative[j] - cumulative[r - 1] (row 0: cumulative[j]);
    inf where the range is empty (j < r)."""
    count = len(cumulative)
    out = np.empty((count + 1, count))
    out[0] = cumulative
    out[1:] = cumulative[None, :] - cumulative[:, None]
    out[1:][np.tril(np.ones((count, count), dtype=bool))] = _INF  # j < r: nothing in the range
    return out


def _rebuild(table: _Table, row: int, end: int, machines: int) -> list[tuple[int, int, int]]:
    """(start row, end state, machines) of the stages of A(row, end, machines), in order."""
    r = table.rows.index(row)
    k = int(table.split[r, end, machines])
    if k < 0:
        return [(row, end, machines)]
    mm = int(table.last[r, end, machines])
    return _rebuild(table, row, k, machines - mm) + [(k + 1, end, mm)]


def data_parallel_time(states: PipeDreamStates, levels: Sequence[Level]) -> float:
    """Time per minibatch of plain data parallelism under PipeDream's model."""
    total = float(states.compute_ms[-1])
    params = float(states.param_bytes[-1])
    within = 1
    for level in levels:
        m = level.machines
        total = (total + 4.0 * (m - 1) * params / (level.bandwidth * m) / within) / m
        within = m
    return total


def optimize(
    states: PipeDreamStates, levels: Sequence[Level], scale: float = 1.0, memory: float | None = None, straight: bool = False
) -> PipeDreamChoice:
    """PipeDream's choice for ``levels`` (lowest first); compute times and activations are
    multiplied by ``scale`` (the minibatch relative to the profile batch); ``memory``: bytes
    per device for PipeDream's memory constraint (None: off, PipeDream's default);
    ``straight``: no replication (PipeDream's straight pipeline)."""
    scaled = PipeDreamStates(
        states.compute_ms * scale, states.param_bytes, states.activation_bytes * scale, states.output_bytes * scale, states.ancestors, states.closure, states.removed
    )
    compute = _range_table(scaled.compute_ms)
    tables = []
    within = 1
    for depth, level in enumerate(levels):
        final = depth == len(levels) - 1
        rows = [0] if final else list(range(scaled.count + 1))
        table = _solve_level(scaled, compute, level, within, rows, memory, straight)
        tables.append(table)
        if not final:
            compute = np.concatenate([table.time[:, :, level.machines]], axis=0)
        within = level.machines
    stages = _unfold(tables, levels, 0, scaled.count - 1, len(levels) - 1)
    pipeline = float(tables[-1].time[0, scaled.count - 1, levels[-1].machines])
    return PipeDreamChoice(tuple(stages), pipeline, data_parallel_time(scaled, levels))


def _unfold(tables: list[_Table], levels: Sequence[Level], row: int, end: int, depth: int) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """Stages of the level ``depth`` solution for states (row - 1, end], split further by
    the levels below: (start row, end state, units per level, index of the enclosing stage
    per level), levels listed lowest first."""
    out = []
    for group, (start, stop, units) in enumerate(_rebuild(tables[depth], row, end, levels[depth].machines)):
        if depth == 0:
            out.append((start, stop, (units,), (group,)))
            continue
        for a, b, inner, groups in _unfold(tables, levels, start, stop, depth - 1):
            out.append((a, b, inner + (units,), groups + (group,)))
    return out
