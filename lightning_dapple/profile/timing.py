"""Wall-clock timing of one call on a device, shared by every profiling probe: CUDA work is
waited for on both sides, so a time is the call's, not its launch's; a measurement is the
median of timed calls after untimed warm-up ones."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["median_ms", "timed_ms"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` and return (milliseconds, result); CUDA work is waited for on both sides."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return (time.perf_counter() - start) * 1000.0, result


def median_ms(device: torch.device, fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """The median milliseconds of ``repeats`` timed calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed_ms(device, fn)[0] for _ in range(repeats))
