"""One line per failed run, not one traceback per rank.

When one rank of a pipelined run raises, every other rank stops too (the failure
channel, ``execute/failure.py``), and each process would print its own traceback: four
ranks, four tracebacks, three of them only saying that a peer failed. Here:

* in a rank process, an uncaught exception prints one line: the rank's own error, or
  nothing when it only stopped because a peer failed (``PeerFailedError``; the failing
  rank prints) or when it is bad configuration that every rank found (rank 0 prints);
* under the multiprocessing launchers (``start_method="spawn"/"fork"``) the launching
  process re-raises a rank's failure as ``DappleRunError`` with that rank's one-line
  message, and prints just that line if nothing catches it.

``DAPPLE_DEBUG=1`` in the environment restores the full tracebacks everywhere.
"""
from __future__ import annotations

import signal
import sys
from types import TracebackType
from typing import Any, Callable

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.multiprocessing import ProcessRaisedException
from typing_extensions import override

from lightning_dapple.errors import DEBUG_ENV, DappleConfigError, debugging
from lightning_dapple.execute.failure import PeerFailedError

PREFIX = "lightning_dapple: error:"
HINT = f"(set {DEBUG_ENV}=1 for tracebacks)"

__all__ = ["DEBUG_ENV", "DappleRunError", "OneLineLauncher", "install_excepthook", "one_line"]


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
    index = getattr(exc, "error_index", None)
    return f"rank {index}: {last}" if index is not None and not last.startswith("rank ") else last


SILENT = -1  # a rank started by the multiprocessing launcher: the launching process reports


def _should_print(value: BaseException, rank: int | None) -> bool:
    if rank == SILENT or isinstance(value, PeerFailedError):
        return False  # the failing rank reports its own error
    if isinstance(value, DappleConfigError) and rank not in (None, 0):
        return False  # every rank checks the same configuration: rank 0 says it
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
        if _should_print(value, current):
            where = f" rank {current}:" if current is not None and not isinstance(value, (DappleConfigError, DappleRunError)) else ""
            sys.stderr.write(f"{PREFIX}{where} {one_line(value) if not isinstance(value, DappleRunError) else value} {HINT}\n")
            sys.stderr.flush()

    excepthook.dapple_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = excepthook


_MISSING = object()


def _root_cause(strategy: Any, exc: Exception) -> Exception:
    """A rank that broke only because a peer failed (e.g. a connection closed under a
    collective) gives the peer's reported error instead of its own symptom."""
    failure = getattr(strategy, "failure", None)
    if failure is None or isinstance(exc, PeerFailedError):
        return exc
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
