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

A rank that dies without raising (SIGKILL, the OOM killer, a segfault) reports nothing.
Its peers' waits on it fail at once ("connection closed"), and so do sends and receives
posted to it (those reach ``report`` as the rank's own error). The first to notice names
it -- a peer on this host by its process (every rank announces host and pid when its
channel starts), else by a heartbeat that stopped, else the peer the receive waited for --
prints one line and publishes that line as the failure, so every rank stops with the dead
rank's name; ranks blocked elsewhere leave after a short grace, since a dead peer never
wakes them. Every watchdog adds one to its rank's heartbeat counter every ``heartbeat_s``; a
rank blocked for long compares its peers' counters, and one silent for
``unresponsive_s`` (a stopped or hung process, whose connections stay open) is reported
the same way, well within ``timeout_s``. When the store itself is gone, its host is: rank
0 under Lightning's launchers, the node-0 agent under torchrun. The first failure
published wins (a ticket counter), so the root cause is what every rank prints.

Under NCCL the waits are on the GPU, and the watchdog bounds them from the side. There a
``Work.wait(timeout)`` makes the host poll the work every millisecond, then synchronise
anyway, while ``Work.wait()`` without a timeout only makes the current CUDA stream wait for
the communication and returns at once: what a pipeline step wants (DAPPLE 5.2: transfers
overlap compute, and the host runs ahead of the GPU). So ``wait_on_device`` waits that way
and files a CUDA event recorded behind the wait with the watchdog, which ends the job if
the event has not completed ``timeout_s`` later (a peer that never sends). Where the host
must read a received value (a flag byte, a header, the step's loss) it blocks on an event
behind the copy of that value alone (``block_on``), bounded by the watchdog the same way:
no exception can interrupt a thread blocked in CUDA. The strategy opens the default group
with this same ``timeout_s`` (``DDPStrategy(timeout=...)``) and every subgroup takes it
(``process_groups.py``), so NCCL's own watchdog would fire at the same time; this one
bounds the waits instead because NCCL's makes every stuck rank print its own report, where
this channel publishes the root cause once, names silent peers and ends a rank ``grace_s``
after a peer's report. A device wait left incomplete counts as blocked for the grace and
silence rules above.

Code that blocks the host outside this channel's own waits marks the block with
``watched`` (the process's open channel, ``current_channel``), so that the grace and
silence rules apply there too: a process group being made (``process_groups.subgroup``:
a communicator split under NCCL waits for every rank), a link's first message (NCCL
connects a pair on it), a BatchNorm's statistics across replicas (``batchnorm.py``),
Lightning's per-batch SIGTERM broadcast (``strategy/reporting.py``), and every device wait
under ``TORCH_NCCL_BLOCKING_WAIT=1``, where ``Work.wait()`` blocks the host.

The module is long because the waits and the watchdog's rules that bound them share one
state (what the host waits for, the peer's report, the heartbeats) and read together.
"""
from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist

FAILURE_KEY = "lightning_dapple/failure"
TICKET_KEY = "lightning_dapple/failure_ticket"
HEARTBEAT_KEY = "lightning_dapple/heartbeat/{rank}"
WHERE_KEY = "lightning_dapple/where/{rank}"
DEATH_MARKS = ("died without reporting", "stopped responding")
DEAD_GRACE_S = 3.0
LONG_WAIT_S = 1800.0  # a wait for one rank's own work: Lightning's default process-group timeout
STORE_LINGER_S = 1.0  # several of the watchdogs' polls (poll_s: 0.25 s by default)


class PeerFailedError(RuntimeError):
    """Another rank raised; the message is that rank's error."""


class CommTimeoutError(RuntimeError):
    """A communication did not finish within the configured timeout."""


class Waiting(NamedTuple):
    """What this rank waits for, since when, and whether the watchdog bounds the wait
    (device waits and host waits on CUDA events; a gloo wait times out by itself)."""

    what: str
    since: float
    bounded_here: bool


class _Watched(NamedTuple):
    """A device wait the host did not block on: when it was filed, its event, what it waits
    for, and the CUDA device of the event (None: not a CUDA event, as in the CPU tests)."""

    since: float
    event: Any
    what: str
    device: int | None


class FailureChannel:
    """Report this rank's failure; wait on ``Work`` handles, failing with a peer's error."""

    def __init__(
        self,
        rank: int,
        timeout_s: float = 120.0,
        poll_s: float = 0.25,
        store: Any = None,
        grace_s: float = 20.0,
        world_size: int | None = None,
        heartbeat_s: float = 1.0,
        unresponsive_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.heartbeat_s = heartbeat_s
        # a live process beats from this thread even while its main thread computes, so a
        # silence of a few heartbeats already means stopped; declared within 3/4 of the
        # wait timeout (watching starts after half this silence of our own wait)
        self.unresponsive_s = unresponsive_s if unresponsive_s is not None else min(timeout_s / 2, 30.0)
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.world_size = world_size
        self._store = store if store is not None else _default_store()
        # the watchdog's own connection: a store client serves one call at a time, and the
        # main thread may be blocked in one (a gloo group's set-up waits there for its peers)
        self._watch_store = own_connection(self._store)
        self._reported = False
        self._peer_message: str | None = None
        self._peer_seen_at = 0.0
        self._blocking: Waiting | None = None  # the host's wait in progress
        self._watched: deque[_Watched] = deque()  # device waits, oldest first (the watchdog pops them)
        self._watch_device: int | None = None  # the CUDA device the watchdog thread has set
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (last counter seen, when it last changed)
        self._last_beat = 0.0
        self._store_gone = False
        self._announce()
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="dapple-watchdog", daemon=True)
        self._watchdog.start()
        _OPEN.append(weakref.ref(self))
        # A daemon thread still inside a store call when the interpreter finalizes is unwound
        # through C++ code that may not be unwound ("terminate called without an active
        # exception", SIGABRT at exit): stop and join it before finalization.
        atexit.register(self.close)

    def _client(self) -> Any:
        """The store connection of the calling thread (the watchdog has its own)."""
        watchdog = getattr(self, "_watchdog", None)  # none yet while the channel starts
        return self._watch_store if watchdog is not None and threading.current_thread() is watchdog else self._store

    @property
    def store(self) -> Any:
        """The job's store, where failures and heartbeats are kept (``store_sync`` waits there too)."""
        return self._store

    # -- reporting --------------------------------------------------------------
    def report(self, exc: BaseException) -> None:
        """Publish this rank's error so that peers stop with the same message."""
        if self._reported or isinstance(exc, PeerFailedError):
            return
        if self._peer_message is not None and _lost_connection(exc):
            return  # the peer that failed first has left: this is its consequence, and its store may be gone
        self._reported = True
        if _lost_connection(exc):  # a send or receive posted to a peer that is gone: name it, not us
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            message, first_to_say = self._name_the_dead(f"a transfer that failed with: {first[:200]}", exc)
            self._peer_message = message
            if first_to_say:
                self._say(f"{message} (seen on rank {self.rank})")
            return
        self._publish(f"rank {self.rank} raised {type(exc).__name__}: {exc}")

    def _publish(self, message: str) -> None:
        """Make ``message`` the job's failure unless another rank published first."""
        try:
            if int(self._client().add(TICKET_KEY, 1)) == 1:
                self._client().set(FAILURE_KEY, message)
        except Exception:  # the store may already be gone at shutdown; nothing else to do
            pass

    def _read_report(self) -> str | None:
        if self._peer_message is None and not self._store_gone:
            try:
                if self._client().check([FAILURE_KEY]):
                    self._peer_message = self._client().get(FAILURE_KEY).decode()
                    self._peer_seen_at = time.monotonic()
            except Exception:  # store unreachable: its host is gone (each failed call logs; ask no more)
                self._store_gone = True
                return None
        return self._peer_message

    def _peer_failed_first(self) -> bool:
        """Raise ``PeerFailedError`` if a peer's failure is already known here and this rank
        reported none of its own (no store call); else False."""
        if self._peer_message is not None and not self._reported:
            self.check()
        return False

    def note_peer_report(self, message: str) -> None:
        """Take a peer's published failure seen elsewhere in this process (the peer watch,
        ``strategy/reporting.py``), so that the waits it wakes ask the store no more: the
        failing rank may serve the store and leave at once."""
        if self._peer_message is None and not message.startswith(f"rank {self.rank} raised"):
            self._peer_message = message
            self._peer_seen_at = time.monotonic()

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
        try:
            with self._blocked(what, bounded_here=False):
                for work in works:
                    left = max(deadline - time.monotonic(), 0.001)
                    work.wait(timedelta(seconds=left))
        except Exception as exc:
            self._raise_for(exc, what)

    def on_store(self, call: Callable[[], Any], what: str) -> Any:
        """``call()``, a store operation made for ``what``: a store that stopped answering
        names its host (rank 0 under Lightning's launchers) as the failure."""
        try:
            return call()
        except Exception as exc:
            self._raise_for(exc, what)

    def wait_until(self, ready: Callable[[], bool], what: str, limit_s: float = LONG_WAIT_S) -> None:
        """Block until ``ready()`` (a store query) holds, for as long as the peers live, up to
        ``limit_s``: what this rank waits for is a peer's own work of any length (rank 0
        planning, or writing a checkpoint; ``store_sync``), bounded as Lightning bounds its
        collectives by default. A peer's report ends the wait with its message; a peer silent
        for ``unresponsive_s`` ends the job (the watchdog's silence rule), and a store that
        stopped answering names its host."""
        if self._peer_message is not None:
            self.check()
        pause = 0.001  # a short wait stays short; a long one polls every poll_s
        deadline = time.monotonic() + limit_s
        try:
            with self._blocked(what, bounded_here=False):
                # a peer's report known here ends the wait before the next query: once it is
                # known the failing rank may leave, and with it the store's host
                while not (self._peer_failed_first() or ready()):
                    self.check()
                    if time.monotonic() > deadline:
                        raise CommTimeoutError(
                            f"rank {self.rank}: waited {limit_s:.0f} s for {what} while every peer kept beating; "
                            "a rank may have skipped a collective call the others made (e.g. one made under 'if rank == 0')"
                        )
                    time.sleep(pause)
                    pause = min(2 * pause, self.poll_s)
        except (PeerFailedError, CommTimeoutError):
            raise
        except Exception as exc:  # the store is gone with its host
            self._raise_for(exc, what)

    @contextmanager
    def _blocked(self, what: str, bounded_here: bool) -> Iterator[None]:
        """Mark the host as waiting for ``what``: the watchdog's grace and silence rules (and
        its timeout, where ``bounded_here``) apply meanwhile. Nested, the outer wait is
        restored at the end of the inner one."""
        outer = self._blocking
        self._blocking = Waiting(what, time.monotonic(), bounded_here)
        try:
            yield
        finally:
            self._blocking = outer

    def blocked(self, what: str, bounded_here: bool = False) -> Any:
        """A context in which the host may block for ``what`` outside this channel's own
        waits (see the module docstring): a peer's report ends the process ``grace_s`` later,
        a silent peer ``unresponsive_s`` later, and, where ``bounded_here`` (a wait nothing
        else bounds: CUDA, an NCCL communicator's set-up), ``timeout_s`` ends it regardless.
        A peer's report known already raises ``PeerFailedError`` at once."""
        if self._peer_message is not None:
            self.check()
        return self._blocked(what, bounded_here)

    # -- waiting on the GPU (NCCL; see the module docstring) ------------------------
    def wait_on_device(self, works: Sequence[Any], what: str, device: int | None) -> None:
        """Make the current CUDA stream wait for ``works`` without blocking the host, and
        have the watchdog end the job if they have not completed ``timeout_s`` from now
        (``device``: the stream's CUDA device index)."""
        if not works:
            return
        if self._peer_message is not None:
            self.check()
        try:
            # marked blocked: under TORCH_NCCL_BLOCKING_WAIT=1 this wait blocks the host
            with self._blocked(what, bounded_here=True):
                for work in works:
                    work.wait()  # no timeout: the stream waits, the host goes on
        except Exception as exc:
            self._raise_for(exc, what)
        done = torch.cuda.Event()
        done.record()
        self.watch(done, what, device)

    def watch(self, event: Any, what: str, device: int | None = None) -> None:
        """File ``event`` (anything with ``query()``) with the watchdog: the job ends if it
        has not completed ``timeout_s`` from now."""
        if not self._closed.is_set():
            self._watched.append(_Watched(time.monotonic(), event, what, device))

    def block_on(self, event: Any, what: str) -> None:
        """Block the host until ``event`` (anything with ``synchronize()``) completes, for a
        value it must read. The watchdog bounds the wait: the process ends after
        ``timeout_s``, or ``grace_s`` after a peer's report."""
        if self._peer_message is not None:
            self.check()
        with self._blocked(what, bounded_here=True):
            event.synchronize()

    def _raise_for(self, exc: BaseException, what: str) -> None:
        """A wait failed: a peer that raised reports before it exits (and its exit is what
        woke us), so prefer its message; else name the rank that died or say what timed out."""
        settle = time.monotonic() + min(0.2, self.timeout_s)  # a raising peer reports before it exits
        while self._read_report() is None and time.monotonic() < settle:
            time.sleep(0.05)
        self.check()
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            silent = self._silent_peers(self.unresponsive_s, wait=False)
            self._end_local(silent)
            raise CommTimeoutError(self._timeout_message(what, silent)) from exc
        message, first_to_say = self._name_the_dead(what, exc)
        self._peer_message = message  # known here even when the store is gone
        self._peer_seen_at = time.monotonic()
        if first_to_say:
            self._say(f"{message} (seen on rank {self.rank})")
        raise PeerFailedError(f"{message} (seen on rank {self.rank})") from exc

    def _timeout_message(self, what: str, silent: list[int]) -> str:
        suspect = f"; rank(s) {silent} stopped beating" if silent else ""
        return (
            f"rank {self.rank}: no progress for {self.timeout_s:.0f} s while waiting for {what}{suspect}; "
            "a peer may be stuck or dead. Raise DappleStrategy(timeout_s=...) if steps are this slow."
        )

    def _name_the_dead(self, what: str, exc: BaseException) -> tuple[str, bool]:
        """The failure line for a broken connection, and whether this rank is the one to print
        it: a rank that raised prints its own error, and a death another rank published first
        was printed there, so the job says what failed once."""
        try:
            self._client().check([FAILURE_KEY])
        except Exception:
            return (
                f"the job's store is unreachable, so its host died ({_store_host()}); "
                f"rank {self.rank} was waiting for {what} ({exc})"
            ), True
        dead = self._dead_peers()
        if not dead:  # nothing certain: the receive's peer is the one whose connection closed
            named = re.search(r"rank (\d+)", what)
            dead = [int(named.group(1))] if named is not None else []
        who = f"rank(s) {dead}" if dead else "a peer"
        message = (
            f"{who} died without reporting an error (killed or crashed); rank {self.rank} was waiting for {what}"
        )
        self._publish(message)
        report = self._read_report()
        return (report or message), report in (None, message)

    # -- heartbeats ---------------------------------------------------------------
    def _announce(self) -> None:
        """Publish where this rank runs, so that a peer on its host can tell it died or end it."""
        try:
            self._client().set(WHERE_KEY.format(rank=self.rank), f"{socket.gethostname()} {os.getpid()}")
        except Exception:  # no store: peers fall back to heartbeats
            pass

    def _beat(self) -> None:
        now = time.monotonic()
        if self._peer_message is not None:
            return  # the job is failing: its store's host may be gone, and a call would only log that
        if now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            try:
                if not self._store_gone:
                    self._client().add(HEARTBEAT_KEY.format(rank=self.rank), 1)
            except Exception:  # store gone: peers learn it from their own store calls
                self._store_gone = True

    def _scan_beats(self) -> None:
        """Record each peer's heartbeat counter and when it last changed."""
        peers = [r for r in range(self.world_size) if r != self.rank]
        if not peers:
            return
        keys = [HEARTBEAT_KEY.format(rank=r) for r in peers]
        try:
            # a peer that never beat yet has no key; counting from zero is the same silence
            present = [key for key in keys if self._client().check([key])]
            values = dict(zip(present, self._client().multi_get(present))) if present else {}
        except Exception:
            return
        now = time.monotonic()
        for peer, key in zip(peers, keys):
            value = int(values.get(key, b"0") or 0)
            seen = self._beats.get(peer)
            if seen is None or seen[0] != value:
                self._beats[peer] = (value, now)

    def _silent_peers(self, window_s: float, wait: bool = True) -> list[int]:
        """Peers whose heartbeat has not moved for ``window_s`` (watching that long if ``wait``)."""
        self._scan_beats()
        deadline = time.monotonic() + (window_s if wait else 0.0)
        while True:
            now = time.monotonic()
            silent = [peer for peer, (_, since) in sorted(self._beats.items()) if now - since >= window_s]
            if silent or now >= deadline:
                return silent
            time.sleep(min(self.heartbeat_s / 2, max(deadline - now, 0.0)))
            self._scan_beats()

    def _dead_peers(self) -> list[int]:
        """Peers known dead: on this host, by their process; elsewhere (or when no process
        here has ended yet), by a heartbeat that stays still for three beats."""
        host = socket.gethostname()
        local = {}
        for rank in range(self.world_size):
            where = self._where(rank) if rank != self.rank else None
            if where is not None and where[0] == host:
                local[rank] = int(where[1])
        remote = len(local) < self.world_size - 1
        # a dying process closes its sockets before it turns into a zombie: look again briefly
        deadline = time.monotonic() + 1.0
        while True:
            dead = [rank for rank, pid in sorted(local.items()) if not _pid_alive(pid)]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if remote or not dead:  # a process slow to exit still stops beating
            dead = sorted(set(dead) | set(self._silent_peers(3 * self.heartbeat_s)))
        return dead

    def _where(self, rank: int) -> list[str] | None:
        """(host, pid) a rank announced, if it did."""
        key = WHERE_KEY.format(rank=rank)
        try:
            if not self._client().check([key]):  # a get of a missing key waits for it
                return None
            return self._client().get(key).decode().split()
        except Exception:
            return None

    def _say(self, line: str) -> None:
        sys.stderr.write(f"lightning_dapple: {line}\n")
        sys.stderr.flush()

    # -- the watchdog ---------------------------------------------------------------
    def _watch(self) -> None:
        """Beat; notice peers' reports and silent peers; end this process if it stays
        blocked ``grace_s`` after a report, a peer it waits on has stopped beating, or a
        wait that the watchdog bounds has lasted ``timeout_s``."""
        while not self._closed.wait(self.poll_s):
            self._beat()
            waiting = self._waiting()
            message = self._read_report()
            if message is None:
                self._watch_silence(waiting)
                self._watch_deadline(waiting)
                continue
            if self._reported or waiting is None:
                continue
            since = max(waiting.since, self._peer_seen_at)
            # a peer that raised may still unwind and free us; a dead one never will
            grace = min(self.grace_s, DEAD_GRACE_S) if any(m in message for m in DEATH_MARKS) else self.grace_s
            if time.monotonic() - since > grace:
                self._say(f"{message} (seen on rank {self.rank}, blocked {grace:.0f} s in {waiting.what}); rank {self.rank} exits")
                os._exit(1)

    def _waiting(self) -> Waiting | None:
        """The host's wait in progress, else the oldest device wait not yet complete."""
        blocking = self._blocking
        if blocking is not None:
            return blocking
        stalled = self._oldest_watched()
        return None if stalled is None else Waiting(stalled.what, stalled.since, True)

    def _oldest_watched(self) -> _Watched | None:
        """Drop the device waits that completed, oldest first; the first that has not."""
        watched = self._watched
        while watched:
            oldest = watched[0]
            if oldest.device is not None and oldest.device != self._watch_device:
                # this thread's device: a query from device 0 would open a CUDA context there
                torch.cuda.set_device(oldest.device)
                self._watch_device = oldest.device
            try:
                if not oldest.event.query():
                    return oldest
            except Exception:  # a CUDA error: the main thread meets it at its next call
                pass
            watched.popleft()
        return None

    def _watch_deadline(self, waiting: Waiting | None) -> None:
        """End the job when a wait that the watchdog bounds has lasted ``timeout_s``."""
        if waiting is None or not waiting.bounded_here or time.monotonic() - waiting.since < self.timeout_s:
            return
        silent = self._silent_peers(self.unresponsive_s, wait=False)
        message = self._timeout_message(waiting.what, silent)
        self._publish(message)
        self._say(f"{message}; rank {self.rank} exits")
        self._exit_published(silent)

    def _watch_silence(self, waiting: Waiting | None) -> None:
        """While blocked for long, compare heartbeats; report a peer silent ``unresponsive_s``."""
        if waiting is None or time.monotonic() - waiting.since < max(4 * self.heartbeat_s, self.unresponsive_s / 2):
            self._beats.clear()
            return
        self._scan_beats()
        now = time.monotonic()
        silent = [peer for peer, (_, since) in sorted(self._beats.items()) if now - since >= self.unresponsive_s]
        if not silent or self._waiting() is None:
            return
        message = (
            f"rank(s) {silent} stopped responding: no heartbeat for {self.unresponsive_s:.0f} s (stopped, hung or killed); "
            f"rank {self.rank} was waiting for {waiting.what}"
        )
        self._publish(message)
        self._say(f"{message}; rank {self.rank} exits")
        self._exit_published(silent)

    def _exit_published(self, silent: list[int]) -> None:
        """End the ``silent`` ranks on this host and this process, after publishing the job's
        failure. Under Lightning's launchers rank 0 serves the store: it first stays a moment,
        while the peers' watchdogs read the failure, so that a peer woken by the end of a
        silent rank (its wait fails at once) knows the failure when the store is gone, rather
        than naming rank 0 as the dead one. The silent ranks are ended after that moment:
        until then nothing wakes this rank's own wait on them."""
        if self.rank == 0:
            time.sleep(STORE_LINGER_S)
        self._end_local(silent)
        os._exit(1)

    def _end_local(self, ranks: list[int]) -> None:
        """SIGKILL the silent ranks that run on this host (a stopped process would outlive
        the job: no launcher reaps a rank whose parent has gone)."""
        host = socket.gethostname()
        for rank in ranks:
            where = self._where(rank)
            if where is not None and where[0] == host:
                try:
                    os.kill(int(where[1]), signal.SIGKILL)
                except (OSError, ValueError):  # gone already
                    pass

    @property
    def closed(self) -> bool:
        """Whether ``close`` has stopped the watchdog."""
        return self._closed.is_set()

    def close(self) -> None:
        """Stop the watchdog and wait for it (the process group is going away)."""
        self._closed.set()
        _OPEN[:] = [ref for ref in _OPEN if ref() is not None and ref() is not self]
        if self._watchdog.is_alive() and threading.current_thread() is not self._watchdog:
            self._watchdog.join(timeout=max(5.0, 4 * self.poll_s))
        atexit.unregister(self.close)


_OPEN: list[weakref.ref] = []  # the open channels of this process (held weakly), oldest first


def current_channel() -> FailureChannel | None:
    """The channel opened last in this process and not closed yet (None: no channel)."""
    for ref in reversed(_OPEN):
        channel = ref()
        if channel is not None and not channel.closed:
            return channel
    return None


@contextmanager
def watched(what: str, bounded_here: bool = False) -> Iterator[None]:
    """``current_channel().blocked(what, bounded_here)``, or nothing where no channel is
    open: for code that blocks the host without holding a channel (see the module
    docstring)."""
    channel = current_channel()
    if channel is None:
        yield
        return
    with channel.blocked(what, bounded_here):
        yield


def own_connection(store: Any) -> Any:
    """A second client of ``store`` (``Store.clone``: a connection of its own), for a thread
    that must reach the store while another thread of the process blocks in a store call on
    the first (a TCP store client answers its calls one at a time); ``store`` itself where it
    cannot be cloned (an older torch)."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store


def _default_store() -> Any:
    return dist.distributed_c10d._get_default_store()


LOST_CONNECTION = ("connection closed by peer", "connection reset by peer", "broken pipe", "read error", "socket closed")


def _lost_connection(exc: BaseException) -> bool:
    """A communication error because a peer's end of the connection went away."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, OSError)) and any(mark in text for mark in LOST_CONNECTION)


def _pid_alive(pid: int) -> bool:
    """Whether a process of this host runs (a zombie has died, only not been reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _store_host() -> str:
    """Who serves the default store: torchrun's agent on node 0, else global rank 0."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return f"the torchrun agent at {where} is gone"
    return f"rank 0, which serves it at {where}, is gone"
