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
        if schedule == "gpipe":
            counts.append(micro_batches)
            continue
        wanted = num_stages - stage if policy == "PA" else 2 * (num_stages - stage) - 1
        cap = micro_batches if memory_limits is None else min(micro_batches, max(1, memory_limits[stage]))
        if counts:
            cap = min(cap, counts[-1] if counts[-1] >= micro_batches else counts[-1] - 1)
        counts.append(max(1, min(wanted, cap)))
    return counts
