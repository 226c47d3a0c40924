"""Warm-up counts K_i: how many forwards stage i runs before its first backward (DAPPLE 5.3).

P_A: K_i = min(S - i, D); P_B: K_i = min(2(S - i) - 1, D). D bounds the micro-batches a
stage may hold at once: M itself, or fewer when the memory model says so. Under GPipe
(all forwards first) K_i is M for every stage.

A memory cap on an early stage caps the stages after it too: stage i-1 sends K_{i-1}
forwards and then waits for its first gradient, which stage i returns after its own K_i
forwards, so K_i <= K_{i-1}; and unless stage i-1 already holds all M micro-batches, stage
i needs one fewer (K_i <= K_{i-1} - 1) or every later forward waits for a round trip
through stage i-1 (the policies' own counts fall by one or two per stage).
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import require
from lightning_dapple.plan.schedule_table import chunked_schedule_names, schedule_spec


def warmup_counts(
    num_stages: int,
    micro_batches: int,
    policy: str = "PA",
    schedule: str = "dapple",
    memory_limits: Sequence[int] | None = None,
) -> list[int]:
    """K_i for each stage i under ``policy``, capped by M and by ``memory_limits[i]``."""
    require(policy in ("PA", "PB"), "policy", f"is {policy!r}", "use 'PA' or 'PB'")
    counts = []
    for stage in range(num_stages):
        if schedule_spec(schedule).holds_every_micro_batch:
            counts.append(micro_batches)
            continue
        wanted = num_stages - stage if policy == "PA" else 2 * (num_stages - stage) - 1
        cap = micro_batches if memory_limits is None else min(micro_batches, max(1, memory_limits[stage]))
        if counts:
            cap = min(cap, counts[-1] if counts[-1] >= micro_batches else counts[-1] - 1)
        counts.append(max(1, min(wanted, cap)))
    return counts


def chunked_warmup_counts(num_groups: int, chunks: int, micro_batches: int, policy: str = "PA", schedule: str = "interleaved") -> list[int]:
    """K per device group of a plan with ``chunks`` stages on each of ``num_groups`` groups.

    With chunks K counts chunk micro-batches (one micro-batch through one chunk): the most
    a group holds at once, which is what its activation memory depends on (DAPPLE 5.3's
    meaning of K_i, summed over the group's chunks). Every stage of a group carries its
    group's K.

    * interleaved (Megatron's interleaved 1F1B, Narayanan et al. 2021 sec. 2.2): K is also
      the number of forwards the group runs before its first backward. The group first
      fills the chunks before its last one with P micro-batches each ((v-1) P forwards),
      then its last chunk follows DAPPLE's rule for a device P - g from the end of the
      pipeline: P_A adds P - g, P_B 2 (P - g) - 1 (Megatron's count). At most vM.
    * zbv (the zero-bubble V schedule): K caps the chunk micro-batches in flight (F done,
      W not done) on every group at 2P, the P micro-batches of two chunks each that the
      first device of 1F1B holds under P_A; P_B allows 4P - 2, twice P_B's 2P - 1. At most 2M.
    """
    require(policy in ("PA", "PB"), "policy", f"is {policy!r}", "use 'PA' or 'PB'")
    require(schedule_spec(schedule).chunked, "schedule", f"is {schedule!r}", f"use one of {list(chunked_schedule_names())} for chunked plans")
    if schedule_spec(schedule).chunk_placement == "vee":
        wanted = 2 * num_groups if policy == "PA" else 4 * num_groups - 2
        return [max(2, min(wanted, 2 * micro_batches))] * num_groups
    counts = []
    for group in range(num_groups):
        last_chunk = num_groups - group if policy == "PA" else 2 * (num_groups - group) - 1
        counts.append(max(1, min((chunks - 1) * num_groups + last_chunk, chunks * micro_batches)))
    return counts
