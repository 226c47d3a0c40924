"""One line per failed run, not one traceback per rank.

When one rank of a pipelined run raises, every other rank stops too (the failure
channel, ``execute/failure.py``), and each process would print its own traceback: four
ranks, four tracebacks, three of them only saying that a peer failed. Here:

* in a rank process, an uncaught exception prints one line: the rank's own error, or
  nothing when it only stopped because a peer failed (``PeerFailedError``; the failing
  rank prints). Which rank speaks is decided by the job's store, for every error type
  alike: the rank whose error was published first (``execute/failure.py``) prints it, the
  others stay quiet. A refusal raised on one rank only (the last stage's loss check, a
  second ``self(...)`` call) is thus printed by that rank, and bad configuration that every
  rank found is printed once, by whichever rank published it first. Without a store
  (before the default process group exists) only rank 0 prints a configuration error;
* the same holds before the strategy's failure channel exists, when one of Lightning's
  own hooks (``prepare_data``, ``setup``, ``configure_model``) fails on one rank: the
  failing rank publishes its error in the job's store before it prints (the first one
  published is the job's failure, as ``execute/failure.py`` has it), every rank watches
  the store from its start (``watch_for_peer_failures``), and a rank whose error comes
  after a peer's -- typically "connection closed by peer" from a collective the failed rank
  left -- stays quiet. The failing rank stays until its peers have seen its report (a
  few seconds at most): under Lightning's launchers rank 0 serves the store, which ends
  with it;
* under the multiprocessing launchers (``start_method="spawn"/"fork"``) the launching
  process re-raises a rank's failure as ``DappleRunError`` with that rank's one-line
  message, and prints just that line if nothing catches it.

``DAPPLE_DEBUG=1`` in the environment restores the full tracebacks everywhere.

A wait that Lightning itself makes between the strategy's steps is watched as well
(``watch_lightning_waits``): the SIGTERM flag Lightning 2.6 broadcasts from rank 0 before
every training batch. A rank blocked there while a peer has failed ends within the failure
channel's grace, as in the strategy's own waits (``execute/failure.py``).
"""
from __future__ import annotations

import atexit
import re
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any, Callable

import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.multiprocessing import ProcessRaisedException
from typing_extensions import override

from lightning_dapple.errors import DEBUG_ENV, DappleConfigError, debugging
from lightning_dapple.execute.failure import FAILURE_KEY, TICKET_KEY, PeerFailedError, own_connection, watched
from lightning_dapple.execute.transfer.wires import waits_on_device

PREFIX = "lightning_dapple: error:"
HINT = f"(set {DEBUG_ENV}=1 for tracebacks)"
SEEN_KEY = "lightning_dapple/failure_seen"  # how many peers have seen the published failure
LINGER_S = 3.0  # longest a failing rank waits for its peers to see its report

__all__ = [
    "DEBUG_ENV", "DappleRunError", "OneLineLauncher", "failure_known", "install_excepthook", "one_line", "publish_failure",
    "stop_at_failure", "watch_for_lightning_waits", "watch_for_peer_failures",
]


class DappleRunError(RuntimeError):
    """A rank of a pipelined run failed; the message is that rank's error on one line."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _rank_line(exc: BaseException) -> str:
    """The last line of a failed rank's traceback text (its exception and message)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else one_line(exc)
    peer = re.fullmatch(r"(?:[\w.]+\.)?PeerFailedError: rank (\d+) raised (.*?)(?: \(seen on rank \d+\))?", last)
    if peer is not None:  # a rank that stopped for a peer's failure: the peer's error, in the same form
        return f"rank {peer.group(1)}: {peer.group(2)}"
    index = getattr(exc, "error_index", None)
    return f"rank {index}: {last}" if index is not None and not last.startswith("rank ") else last


SILENT = -1  # a rank started by the multiprocessing launcher: the launching process reports


def _should_print(value: BaseException, rank: int | None) -> bool:
    if rank == SILENT or isinstance(value, PeerFailedError):
        return False  # the failing rank reports its own error
    if isinstance(value, DappleConfigError) and rank not in (None, 0) and _job_store() is None:
        return False  # no store to agree on a speaker: every rank checks the same configuration, rank 0 says it
    return True


def install_excepthook(rank: int | None) -> None:
    """Make an uncaught exception print one line (see the module docstring).

    ``rank`` is this process's global rank inside a run, ``SILENT`` in a rank whose
    launching process reports for it, or None in a launching process (where only
    ``DappleRunError`` and ``DappleConfigError`` are shortened). Installing again only
    updates the rank.
    """
    hook = sys.excepthook
    if getattr(hook, "dapple_rank", _MISSING) is not _MISSING:
        hook.dapple_rank = rank  # type: ignore[attr-defined]
        return
    previous = hook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        current = excepthook.dapple_rank  # type: ignore[attr-defined]
        ours = isinstance(value, (DappleRunError, DappleConfigError)) or (current is not None and isinstance(value, Exception))
        if debugging() or not ours:
            previous(kind, value, tb)
            return
        if not _should_print(value, current):
            if isinstance(value, PeerFailedError):
                _leave_the_store()  # the failing rank may be waiting for that
            return
        first = current is None or isinstance(value, DappleRunError) or _peer_failure(value, current) is None
        if not first:
            _leave_the_store()
            return  # a peer failed first and says so; this error is its consequence
        where = f" rank {current}:" if current is not None and not isinstance(value, (DappleConfigError, DappleRunError)) else ""
        sys.stderr.write(f"{PREFIX}{where} {one_line(value) if not isinstance(value, DappleRunError) else value} {HINT}\n")
        sys.stderr.flush()
        if current is not None:
            _linger_until_seen()

    excepthook.dapple_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = excepthook


_MISSING = object()


def _job_store() -> Any:
    """The default process group's store (None outside a distributed run)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def _peer_failure(exc: BaseException, rank: int) -> str | None:
    """Publish this rank's error as the job's failure unless one is published already; the
    job's failure when it is another rank's (None: this rank's, which it is to report)."""
    global _FAILED
    _FAILED = True
    if _WATCH is not None and _WATCH.peer_report is not None:
        return _WATCH.peer_report  # seen (and acknowledged) already: no store call (its host may be gone)
    store = _job_store()
    if store is None:
        return None
    try:
        if int(store.add(TICKET_KEY, 1)) == 1:
            store.set(FAILURE_KEY, f"rank {rank} raised {type(exc).__name__}: {exc}")
            return None
        deadline = time.monotonic() + 1.0  # the first publisher writes its message right after its ticket
        while not store.check([FAILURE_KEY]) and time.monotonic() < deadline:
            time.sleep(0.05)
        message = store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
    except Exception:  # the store's host (rank 0) is gone: what its report said, if this rank saw it
        return _WATCH.peer_report if _WATCH is not None else None
    return None if message is None or message.startswith(f"rank {rank} raised") else message


def _acknowledge(store: Any = None) -> None:
    """Count this rank, once, among the peers that have seen the job's failure (through
    ``store``, a connection of the calling thread's, or the job's)."""
    global _ACKNOWLEDGED
    store = store if store is not None else _job_store()
    with _ACK_LOCK:  # the watch thread and the failing main thread may both get here
        if _ACKNOWLEDGED or store is None:
            return
        _ACKNOWLEDGED = True
    try:
        store.add(SEEN_KEY, 1)
    except Exception:  # the store's host is gone: nobody waits for the count
        pass


_CHANNELS: list[Any] = []  # this rank's failure channels (execute/failure.py), told of a peer's failure


def stop_at_failure(channel: Any) -> None:
    """Tell ``channel`` (a ``FailureChannel``) of a peer's failure as soon as the peer watch
    sees it, before this rank lets the failing rank leave, and close it when this rank stops
    for that failure: the failing rank serves the job's store under Lightning's launchers,
    and a store call after it left prints c10d's connection warnings."""
    _CHANNELS[:] = [earlier for earlier in _CHANNELS if not earlier.closed]  # a fit's channel closes at its end
    _CHANNELS.append(channel)


def _leave_the_store() -> None:
    """Stop this rank's store users, then count it among those that saw the failure."""
    while _CHANNELS:
        try:
            _CHANNELS.pop().close()
        except Exception:  # stopping is best effort: the rank is ending
            pass
    if _WATCH is not None:
        _WATCH.close()
    _acknowledge()


def _linger_until_seen() -> None:
    """Keep this failed rank (and the store it may serve) up until every peer has seen its
    report, or ``LINGER_S`` has passed."""
    store = _job_store()
    if store is None:
        return
    peers = dist.get_world_size() - 1
    deadline = time.monotonic() + LINGER_S
    try:
        while int(store.add(SEEN_KEY, 0)) < peers and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone: nobody left to wait for
        pass


class _PeerWatch:
    """Watches the job's store for a failure another rank published, from the rank's start:
    the rank then knows its own later error is that failure's consequence, hands the message
    to its failure channels (their waits, woken by the failing rank's exit, then need no
    store call) and counts itself in ``SEEN_KEY`` so that the failing rank can leave."""

    def __init__(self, store: Any, rank: int, poll_s: float = 0.25) -> None:
        self.store = own_connection(store)  # the main thread may be blocked in a call on the job's
        self.rank = rank
        self.poll_s = poll_s
        self.peer_report: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dapple-peer-watch", daemon=True)
        self._thread.start()
        # a daemon thread inside a store call at interpreter exit can abort the process (failure.py)
        atexit.register(self.close)

    def _run(self) -> None:
        while not self._closed.wait(self.poll_s):
            try:
                if not self.store.check([FAILURE_KEY]):
                    continue
                message = self.store.get(FAILURE_KEY).decode()
                if not message.startswith(f"rank {self.rank} raised"):
                    self.peer_report = message
                    for channel in _CHANNELS:  # its waits then need no store call once woken
                        channel.note_peer_report(message)
                    _acknowledge(self.store)
            except Exception:  # the store's host is gone
                pass
            return

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
        atexit.unregister(self.close)


_WATCH: _PeerWatch | None = None
_FAILED = False  # this process has raised to the top (see ``failure_known``)
_ACKNOWLEDGED = False  # this process is counted in SEEN_KEY
_ACK_LOCK = threading.Lock()


def failure_known() -> bool:
    """Whether this rank has failed or seen a peer's published failure: its exit then
    leaves the process groups alone (a peer that is gone can keep their clean-up waiting)."""
    return _FAILED or (_WATCH is not None and _WATCH.peer_report is not None)


def watch_for_peer_failures(rank: int) -> None:
    """Start watching for a peer's published failure (see the module docstring); call once
    the default process group exists. A second call replaces the first watch."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.close()
    store = _job_store()
    _WATCH = _PeerWatch(store, rank) if store is not None else None


def publish_failure(strategy: Any, exc: BaseException) -> None:
    """Publish this rank's error as the job's failure (unless a peer's came first) as soon
    as Lightning reports it (``Strategy.on_exception``), before the Trainer's teardown closes
    this rank's connections: a peer blocked in a transfer from this rank would otherwise see
    a closed connection first and take this rank for one that died without a word."""
    if isinstance(exc, PeerFailedError) or not isinstance(exc, Exception):
        return
    failure = getattr(strategy, "failure", None)
    if failure is not None and not failure.closed:
        failure.report(exc)
    elif _job_store() is not None:
        _peer_failure(exc, strategy.global_rank)


def _root_cause(strategy: Any, exc: Exception) -> Exception:
    """A rank that broke only because a peer failed (e.g. a connection closed under a
    collective) gives the peer's reported error instead of its own symptom. Before the
    strategy's failure channel exists, the failure published first is the root cause; a
    rank whose own error it is stays until its peers have seen it."""
    failure = getattr(strategy, "failure", None)
    if isinstance(exc, PeerFailedError):
        return exc
    if failure is None:
        peer = _peer_failure(exc, strategy.global_rank)
        if peer is None:
            _linger_until_seen()
            return exc
        return PeerFailedError(f"{peer} (seen on rank {strategy.global_rank})")
    try:
        failure.check()
    except PeerFailedError as peer:
        if not str(peer).startswith(f"rank {strategy.global_rank} raised"):
            return peer
    except Exception:  # the store may be gone: keep the rank's own error
        pass
    return exc


class OneLineLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher whose rank failures arrive as one line: in
    a rank, the root cause (the failing peer's error) is what goes back to the launching
    process; there, it becomes ``DappleRunError``."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._wrapping_function(*args, **kwargs)
        except Exception as exc:
            # The launching process terminates the other ranks once one failed; Lightning's
            # SIGTERM handler would then run a collective with dead peers and print its own
            # traceback. A rank that already failed just ends.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            cause = _root_cause(self._strategy, exc)
            if cause is exc:
                raise
            raise cause from exc

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessRaisedException as exc:
            if debugging():
                raise
            raise DappleRunError(_rank_line(exc)) from None


SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"  # Lightning 2.6's training epoch loop, before every batch


def watch_for_lightning_waits(trainer: Any) -> None:
    """Have the failure channel watch the collective Lightning's training loop makes before
    every batch: the SIGTERM flag broadcast from rank 0 over the default group (Lightning
    2.6; absent in older releases, where there is nothing to watch). A rank blocked there
    while a peer has failed or stopped ends by the channel's rules (grace, silence) rather
    than the process group's timeout; under NCCL, where the host blocks in CUDA reading the
    flag, the channel's ``timeout_s`` bounds it too. Wrapped once per loop."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    broadcast = getattr(type(loop), SIGTERM_BROADCAST, None)
    if broadcast is None or getattr(loop, "_dapple_watched", False):
        return
    device = trainer.strategy.root_device

    def watched_broadcast() -> None:
        with watched("Lightning's per-batch SIGTERM broadcast from rank 0", bounded_here=waits_on_device(device)):
            broadcast(loop)

    setattr(loop, SIGTERM_BROADCAST, watched_broadcast)
    loop._dapple_watched = True
