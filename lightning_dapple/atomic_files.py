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

__all__ = ["atomic_write", "atomic_write_text", "file_mode", "fsync_directory", "remove_stale_temporaries"]


def file_mode() -> int:
    """The mode ``open()`` would give a new file: 0666 less the umask (0644 under the usual
    022), as Lightning's own checkpoints get; ``mkstemp`` creates 0600, unreadable to the
    group that may share the directory. The umask is read from ``/proc`` where it can be
    (setting it to read it is not safe while other threads create files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
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
        os.fchmod(handle, file_mode())
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
