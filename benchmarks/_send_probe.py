"""Bytes the executor's sends keep alive: the buffers of sends issued and not yet waited.

A send hands its buffer to the wire (``execute/transfer/transport.py``: an activation packed into one
message, a gradient's rows) and keeps it until the send is waited -- by a settle point
(``schedule/settle.py``) or at the end of the step. ``PendingSendBytes`` wraps one
transport's issue calls for the length of a ``with`` block and keeps the peak of the bytes
pending after each: what the sends add to a step's memory beside the stash.
"""
from __future__ import annotations

from typing import Any

import torch


def _pending_bytes(transport: Any) -> int:
    return sum(kept.numel() * kept.element_size() for _, kept, _, _ in transport._pending_sends if isinstance(kept, torch.Tensor))


class PendingSendBytes:
    """``with PendingSendBytes(runner.transport) as sends: ...``; then ``sends.peak``."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.peak = 0

    def __enter__(self) -> "PendingSendBytes":
        transport = self.transport
        for name in ("_isend", "_issue"):
            original = getattr(transport, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                result = _original(*args, **kwargs)
                self.peak = max(self.peak, _pending_bytes(transport))
                return result

            setattr(transport, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in ("_isend", "_issue"):
            delattr(self.transport, name)  # the class's methods again
