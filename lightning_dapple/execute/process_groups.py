"""Subgroups that wait as long as the job's default group, not torch's default.

``torch.distributed.new_group`` without a ``timeout`` gives the new group torch's default
(10 minutes for NCCL, 30 for gloo), whatever the default group was opened with; the
strategy opens the default group with its ``timeout_s``. Every subgroup the package makes
(replica groups, tied-parameter groups, the wires' link groups, the probes') is made here
with the default group's timeout, so a dead peer ends every wait within the same bound.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

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
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, **options)
