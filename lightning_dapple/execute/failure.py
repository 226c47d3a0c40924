"""Bounded waits and failure propagation between ranks.

A pipeline rank blocked in a receive cannot learn by itself that a peer raised. Three
facts about gloo shape the design (each checked on torch 2.13):

* a point-to-point ``Work`` never reports completion before ``wait()``, and it has no
  future, so completion cannot be polled;
* a ``wait(timeout)`` that times out closes the connection for good, so waits cannot be
  sliced into short polls;
* neither ``abort()`` nor destroying the process group from another thread wakes a blocked
  ``wait()``; the peer's process exiting does, at once ("connection closed by peer").

So the calling thread waits on the ``Work`` itself, with the whole ``timeout_s`` as the
only deadline. (An earlier design handed every wait to a helper thread and polled, which
cost two thread switches per wait on the pipeline's hot path.)
A rank that raises writes its message under one store key (``report``) before it unwinds;
when it exits, the peers blocked on it wake with a connection error, read the key, and
raise ``PeerFailedError`` with that message; their exits wake the ranks blocked on them
in turn. A watchdog thread polls the key every ``poll_s``; when a peer has failed but
this rank stays blocked for ``grace_s`` (a peer that raised but did not exit), it prints
the peer's message and ends the process, so no rank outlives a failure by more than
``grace_s`` plus a poll, and ``timeout_s`` bounds every wait regardless.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Sequence

import torch.distributed as dist

FAILURE_KEY = "lightning_dapple/failure"


class PeerFailedError(RuntimeError):
    """Another rank raised; the message is that rank's error."""


class CommTimeoutError(RuntimeError):
    """A communication did not finish within the configured timeout."""


class FailureChannel:
    """Report this rank's failure; wait on ``Work`` handles, failing with a peer's error."""

    def __init__(
        self,
        rank: int,
        timeout_s: float = 120.0,
        poll_s: float = 0.25,
        store: Any = None,
        grace_s: float = 20.0,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self._store = store if store is not None else _default_store()
        self._reported = False
        self._peer_message: str | None = None
        self._peer_seen_at = 0.0
        self._blocked_on: str | None = None
        self._blocked_since = 0.0
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="dapple-watchdog", daemon=True)
        self._watchdog.start()
        # A daemon thread still inside a store call when the interpreter finalizes is unwound
        # through C++ code that may not be unwound ("terminate called without an active
        # exception", SIGABRT at exit): stop and join it before finalization.
        atexit.register(self.close)

    # -- reporting --------------------------------------------------------------
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

    def _read_report(self) -> str | None:
        if self._peer_message is None:
            try:
                if self._store.check([FAILURE_KEY]):
                    self._peer_message = self._store.get(FAILURE_KEY).decode()
                    self._peer_seen_at = time.monotonic()
            except Exception:  # store unreachable: its host rank is gone
                return None
        return self._peer_message

    @property
    def failed(self) -> bool:
        """Whether this rank or a peer has reported a failure."""
        return self._reported or self._read_report() is not None

    @property
    def known_failed(self) -> bool:
        """Whether this rank has already seen a failure (its own or a peer's), without asking
        the store (at exit its host may be gone)."""
        return self._reported or self._peer_message is not None

    def check(self) -> None:
        """Raise ``PeerFailedError`` if some rank has reported a failure."""
        message = self._read_report()
        if message is not None:
            raise PeerFailedError(f"{message} (seen on rank {self.rank})")

    # -- waiting ------------------------------------------------------------------
    def wait(self, work: Any, what: str) -> None:
        """Block until ``work`` completes; raise the peer's error if one failed, or
        ``CommTimeoutError`` after ``timeout_s``."""
        self.wait_all((work,), what)

    def wait_all(self, works: Sequence[Any], what: str) -> None:
        """``wait`` for several ``Work`` handles under one deadline."""
        if not works:
            return
        if self._peer_message is not None:
            self.check()
        deadline = time.monotonic() + self.timeout_s
        self._blocked_on, self._blocked_since = what, time.monotonic()
        try:
            for work in works:
                left = max(deadline - time.monotonic(), 0.001)
                work.wait(timedelta(seconds=left))
        except Exception as exc:
            self._raise_for(exc, what)
        finally:
            self._blocked_on = None

    def _raise_for(self, exc: BaseException, what: str) -> None:
        """A wait failed: a peer that raised reports before it exits (and its exit is what
        woke us), so prefer its message; else say what timed out or broke."""
        settle = time.monotonic() + min(5.0, self.timeout_s)
        while self._read_report() is None and time.monotonic() < settle:
            time.sleep(0.05)
        self.check()
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise CommTimeoutError(
                f"rank {self.rank}: no progress for {self.timeout_s:.0f} s while waiting for {what}; "
                "a peer may be stuck or dead. Raise DappleStrategy(timeout_s=...) if steps are this slow."
            ) from exc
        raise CommTimeoutError(f"rank {self.rank}: {what} failed: {exc}") from exc

    # -- the watchdog ---------------------------------------------------------------
    def _watch(self) -> None:
        """Notice peers' reports; end this process if it stays blocked ``grace_s`` after one."""
        while not self._closed.wait(self.poll_s):
            message = self._read_report()
            if message is None or self._reported:
                continue
            blocked = self._blocked_on
            since = max(self._blocked_since, self._peer_seen_at)
            if blocked is not None and time.monotonic() - since > self.grace_s:
                sys.stderr.write(
                    f"lightning_dapple: {message} (seen on rank {self.rank}, blocked {self.grace_s:.0f} s in {blocked}); "
                    f"rank {self.rank} exits\n"
                )
                sys.stderr.flush()
                os._exit(1)

    def close(self) -> None:
        """Stop the watchdog and wait for it (the process group is going away)."""
        self._closed.set()
        if self._watchdog.is_alive() and threading.current_thread() is not self._watchdog:
            self._watchdog.join(timeout=max(5.0, 4 * self.poll_s))
        atexit.unregister(self.close)


def _default_store() -> Any:
    return dist.distributed_c10d._get_default_store()
