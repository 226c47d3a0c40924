"""What every schedule with several stages (chunks) per device group shares.

Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2) and the zero-bubble V schedule place
``chunks`` stages on each of P device groups. A builder decides one merged order of
compute actions per group; this module turns those orders into a :class:`Schedule`:

* ``placement``: the group of each stage (``plan.plan.chunk_placement``): stage k on group k mod P
  when interleaved, and the V shape 0, 1, ..., P-1, P-1, ..., 0 for ``zbv``;
* ``orders``: each group's order with its transfers (``builders.with_transfers``: receive
  before, send after) and, at the end, one ALLREDUCE per stage of the group;
* ``actions``: each stage's own actions, in the order they have in its group's order.

A boundary between two stages of the same group keeps its SEND/RECV pair: the hand-off is
local (the simulator charges nothing, the executor passes the tensor in-process), but every
stage's list reads like a stage of a one-stage-per-group schedule.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.builders import with_transfers


def schedule_from_orders(
    name: str,
    micro_batches: int,
    placement: Sequence[int],
    compute_orders: Sequence[Sequence[Action]],
    warmups: Sequence[int],
    recompute: Sequence[str] = (),
) -> Schedule:
    """The :class:`Schedule` whose group ``g`` runs ``compute_orders[g]`` (compute actions
    only; transfers and AllReduce markers are added here). ``warmups`` are per stage."""
    num_stages = len(placement)
    orders = []
    for group, order in enumerate(compute_orders):
        merged = [expanded for action in order for expanded in with_transfers(action, num_stages)]
        merged += [Action(Kind.ALLREDUCE, stage) for stage in range(num_stages) if placement[stage] == group]
        orders.append(tuple(merged))
    actions = tuple(tuple(a for a in orders[placement[stage]] if a.stage == stage) for stage in range(num_stages))
    return Schedule(
        name,
        num_stages,
        micro_batches,
        tuple(int(k) for k in warmups),
        actions,
        recompute=tuple(recompute),
        placement=tuple(placement),
        orders=tuple(orders),
    )
