"""The one place that decides how wide the package's tables print.

Rich fits a table to its console's width and, when the output is not a terminal, assumes
80 columns: a plan table piped to a file or a CI log then has every header cut to "sta…"
and its numbers truncated. Here a console on a terminal keeps the terminal's width (rich
wraps cells to fit it, nothing is lost from view), and a console on anything else -- a
pipe, a file, a string -- has room for every table at its natural width.

It sits in the plan layer because the plan tables (``plan.explain``) are its first users
and every part that prints one (strategy, app, command lines) lies above it.
"""
from __future__ import annotations

import io
import sys
from typing import IO, Any

from rich.console import Console

__all__ = ["UNBOUNDED_COLUMNS", "make_console", "render_text"]

# wide enough for any table the package prints; rich pads a table only to its own width
UNBOUNDED_COLUMNS = 100_000


def make_console(file: IO[str] | None = None, record: bool = False) -> Console:
    """A console on ``file`` (default: standard output): the terminal's width when that
    stream is a terminal as the console is made, unbounded otherwise."""
    console = Console(file=file, record=record)
    if not _is_terminal(file if file is not None else sys.stdout):
        console.width = UNBOUNDED_COLUMNS
    return console


def render_text(renderable: Any) -> str:
    """Plain text of a rich renderable at its full width, without colour codes (for the
    ``.txt`` files written beside a run)."""
    console = make_console(io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal; a stream that cannot say (closed, or a stand-in
    without ``isatty``) is not."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
