"""Files written so that a reader sees the old content or the new, never half of either.

Plans, profiles, run reports and checkpoints are read by other processes (ranks, a
resumed run, a sweep's summary) and may be interrupted by a killed process or a power
loss. Every writer in the package goes through ``atomic_write``: the content goes to a
hidden temporary file beside the target (``.<name>.<random>.tmp``, so a glob for the
target's pattern never picks it), is flushed and fsynced, renamed over the target (one
step on a POSIX file system), and the directory is fsynced so the rename itself survives.
The file gets the mode a plain ``open()`` would give it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "atomic_write_text", "fsync_directory", "remove_stale_temporaries"]


def _file_mode() -> int:
    """What ``open(path, "w")`` creates: 0o666 less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a power loss right after it keeps the new name)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def remove_stale_temporaries(target: Path) -> None:
    """Drop temporaries a killed writer of ``target`` left behind."""
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        try:
            stale.unlink()
        except OSError:
            pass


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(stream)`` on a temporary file beside ``path``, then put it in ``path``'s place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(handle, _file_mode())
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, target)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    fsync_directory(target.parent)
    return target


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write`` of ``text`` in UTF-8."""
    return atomic_write(path, lambda stream: stream.write(text.encode("utf-8")))
