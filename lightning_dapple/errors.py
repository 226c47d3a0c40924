"""One error type for every piece of bad input, so front ends can print one line and exit 2.

The guide asks that bad input fail before training with a message that names what is
wrong and how to fix it; `DappleConfigError` carries both parts so the CLI, the Hydra app
and the Lightning strategy all phrase it the same way.
"""
from __future__ import annotations

import os

# ``DAPPLE_DEBUG=1`` asks for every diagnostic: full tracebacks on every rank, and with an
# executor error the step's action list of the failing stage.
DEBUG_ENV = "DAPPLE_DEBUG"


def debugging() -> bool:
    """Whether ``DAPPLE_DEBUG`` is set to something other than empty, 0 or false."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false", "False")


class DappleConfigError(ValueError):
    """Bad user input: `field` names what is wrong, `fix` says what to do about it."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


def require(condition: bool, field: str, problem: str, fix: str) -> None:
    """Raise `DappleConfigError(field, problem, fix)` unless `condition` holds."""
    if not condition:
        raise DappleConfigError(field, problem, fix)
