"""Bounded waits and failure propagation between ranks.

A pipeline rank blocked in a receive cannot learn by itself that a peer raised: with gloo
a point-to-point ``Work`` never reports completion before ``wait()``, and a ``wait`` that
times out closes the connection for good, so waits cannot be sliced. Instead a daemon
thread does the blocking ``wait()`` while the calling thread polls the rendezvous store
for a failure report. A rank that raises writes its message under one key; every other
rank's next poll sees it and raises ``PeerFailedError`` with that message, so the whole
run stops with the original error within ``poll_s`` (plus the time the failing rank
needs to reach its handler), and a hard ``timeout_s`` bounds any wait regardless.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Sequence

import torch.distributed as dist

FAILURE_KEY = "lightning_dapple/failure"


class PeerFailedError(RuntimeError):
    """Another rank raised; the message is that rank's error."""


class CommTimeoutError(RuntimeError):
    """A communication did not finish within the configured timeout."""


class _Pending:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class FailureChannel:
    """Report this rank's failure; wait on ``Work`` handles while watching for peers'."""

    def __init__(self, rank: int, timeout_s: float = 120.0, poll_s: float = 0.05, store: Any = None) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._store = store if store is not None else _default_store()
        self._jobs: "queue.SimpleQueue[tuple[Any, _Pending]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="dapple-waiter", daemon=True)
        self._thread.start()
        self._reported = False

    def _serve(self) -> None:
        while True:
            works, pending = self._jobs.get()
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:  # handed back to the waiting thread
                pending.error = exc
            pending.done.set()

    def report(self, exc: BaseException) -> None:
        """Publish this rank's error so that peers stop with the same message."""
        if self._reported or isinstance(exc, PeerFailedError):
            return
        self._reported = True
        message = f"rank {self.rank} raised {type(exc).__name__}: {exc}"
        try:
            self._store.set(FAILURE_KEY, message)
        except Exception:  # the store may already be gone at shutdown; nothing else to do
            pass

    def check(self) -> None:
        """Raise ``PeerFailedError`` if some rank has reported a failure."""
        if self._store.check([FAILURE_KEY]):
            message = self._store.get(FAILURE_KEY).decode()
            raise PeerFailedError(f"{message} (seen on rank {self.rank})")

    def wait(self, work: Any, what: str) -> None:
        """Block until ``work`` completes, a peer fails, or ``timeout_s`` passes."""
        self.finish(self.start((work,)), what)

    def wait_all(self, works: "Sequence[Any]", what: str) -> None:
        """``wait`` for several ``Work`` handles with one hand-off to the waiter thread
        (a step's pending sends are waited together: one thread switch, not one each)."""
        if works:
            self.finish(self.start(works), what)

    def start(self, works: "Sequence[Any]") -> "_Pending":
        """Hand ``works`` to the waiter thread now; ``finish`` collects them later. A
        receive posted ahead is started when posted, so by the time the rank needs it the
        wait is usually over and ``finish`` returns without a thread switch. Works are
        waited in the order they were started: start only what is due first."""
        pending = _Pending()
        self._jobs.put((tuple(works), pending))
        return pending

    def finish(self, pending: "_Pending", what: str) -> None:
        """Block until the started works complete, a peer fails, or ``timeout_s`` passes."""
        deadline = time.monotonic() + self.timeout_s
        while not pending.done.wait(self.poll_s):
            self.check()
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"rank {self.rank}: no progress for {self.timeout_s:.0f} s while waiting for {what}; "
                    "a peer may be stuck or dead. Raise DappleStrategy(timeout_s=...) if steps are this slow."
                )
        if pending.error is not None:
            self.check()
            raise CommTimeoutError(f"rank {self.rank}: {what} failed: {pending.error}") from pending.error


def _default_store() -> Any:
    return dist.distributed_c10d._get_default_store()
