"""Interleaved 1F1B: Megatron's schedule for several stages (chunks) per device group.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", sec. 2.2.2) cut the model into v * P stages and place stage k on
device group k mod P, so each group runs v chunks and a micro-batch visits every group v
times. The pipeline fills v times faster: the bubble shrinks from (P-1)/M of a step's
compute to (P-1)/(v M), for v times as many transfers.

Order of a group (``group_order``). Micro-batches go in rounds of P: a round's P
micro-batches run through chunk 0, then chunk 1, ..., chunk v-1 (forwards), and the
backwards walk the chunks the other way, v-1 down to 0. This is why M must be a multiple
of P: a round shorter than P leaves the next chunk's group waiting for inputs that the
round did not send, and the plan is refused with the fix (``plan.plan.require_round_multiple``).
On that forward sequence the group applies DAPPLE's early backward (sec. 3.2, 5.3): K
forwards, then strictly one backward, one forward, ..., then the remaining backwards.
K is the group's (``plan.warmup.chunked_warmup_counts``): it counts chunk micro-batches,
the most the group holds at once.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.plan import require_round_multiple
from lightning_dapple.plan.warmup import chunked_warmup_counts
from lightning_dapple.schedule.actions import Action, Kind, Schedule
from lightning_dapple.schedule.chunked import chunked_placement, schedule_from_orders


def virtual_sequence(num_groups: int, chunks: int, micro_batches: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in the order every group runs its forwards (or backwards)."""
    sequence = []
    per_round = num_groups * chunks
    for index in range(chunks * micro_batches):
        round_, within = divmod(index, per_round)
        chunk, offset = divmod(within, num_groups)
        sequence.append((chunks - 1 - chunk if backward else chunk, round_ * num_groups + offset))
    return sequence


def group_order(group: int, num_groups: int, chunks: int, micro_batches: int, warmup: int) -> list[Action]:
    """Compute actions of ``group``: K forwards, then one backward / one forward, then the rest."""
    forwards = [Action(Kind.F, c * num_groups + group, mb) for c, mb in virtual_sequence(num_groups, chunks, micro_batches, False)]
    backwards = [Action(Kind.B, c * num_groups + group, mb) for c, mb in virtual_sequence(num_groups, chunks, micro_batches, True)]
    warmup = max(1, min(warmup, len(forwards)))
    order = forwards[:warmup]
    for index, backward in enumerate(backwards):
        order.append(backward)
        if warmup + index < len(forwards):
            order.append(forwards[warmup + index])
    return order


def build_interleaved_schedule(
    num_groups: int,
    chunks: int,
    micro_batches: int,
    warmups: Sequence[int] | None = None,
    policy: str = "PA",
    recompute: Sequence[str] = (),
) -> Schedule:
    """Interleaved 1F1B on ``num_groups`` groups of ``chunks`` stages for M micro-batches.

    ``warmups``: K per group (default: ``chunked_warmup_counts`` under ``policy``);
    ``recompute``: a mode per stage. The schedule's ``warmups`` repeat each group's K for
    each of its stages.
    """
    require(num_groups >= 1, "num_groups", f"is {num_groups}", "use at least one device group")
    require(chunks >= 2, "chunks", f"is {chunks}", "use 2 or more chunks per group (1 chunk is the 'dapple' schedule)")
    require(micro_batches >= 1, "micro_batches", f"is {micro_batches}", "use at least one micro-batch")
    require_round_multiple(num_groups, micro_batches)
    if warmups is None:
        warmups = chunked_warmup_counts(num_groups, chunks, micro_batches, policy, "interleaved")
    require(len(warmups) == num_groups, "warmups", f"has {len(warmups)} entries for {num_groups} device groups", "give one K per device group")
    placement = chunked_placement("interleaved", num_groups, chunks)
    orders = [group_order(g, num_groups, chunks, micro_batches, warmups[g]) for g in range(num_groups)]
    used = [min(max(1, k), chunks * micro_batches) for k in warmups]
    return schedule_from_orders("interleaved", micro_batches, placement, orders, [used[g] for g in placement], recompute)
