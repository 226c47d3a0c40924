"""Subgroups that wait as long as the job's default group, not torch's default.

``torch.distributed.new_group`` without a ``timeout`` gives the new group torch's default
(10 minutes for NCCL, 30 for gloo), whatever the default group was opened with; the
strategy opens the default group with its ``timeout_s``. Every subgroup the package makes
(replica groups, tied-parameter groups, the wires' link groups, the probes') is made here
with the default group's timeout, so a dead peer ends every wait within the same bound.

Making a group is itself a wait for every rank of the default group: under NCCL, with the
default group bound to a device (Lightning binds it), ``new_group`` splits the new
communicator from the default one at once, and ``ncclCommSplit`` blocks the host until
every rank has called it, with no timeout of its own. So ``subgroup`` marks the host as
blocked with the process's failure channel (``failure.watched``): a peer that failed
before it got there ends this rank ``grace_s`` after its report, a silent one after
``unresponsive_s``, and under NCCL the channel's ``timeout_s`` bounds the split.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_dapple.execute.failure import watched

__all__ = ["default_timeout", "subgroup"]


def default_timeout() -> timedelta | None:
    """The default group's timeout, or None where it cannot be read (no group, an older torch)."""
    try:
        group = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError, AttributeError):
        return None
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, ValueError, AttributeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def subgroup(ranks: Sequence[int] | None = None, backend: str | None = None) -> Any:
    """``dist.new_group(ranks, backend)`` with the default group's timeout (a collective of
    the whole default group, as ``new_group`` is)."""
    timeout = default_timeout()
    options = {"timeout": timeout} if timeout is not None else {}
    members = list(ranks) if ranks is not None else None
    split = "nccl" in str(backend or dist.get_backend()).lower()  # a split has no timeout of its own
    with watched(f"every rank to make the process group of ranks {members if members is not None else 'all'}", bounded_here=split):
        return dist.new_group(members, backend=backend, **options)
