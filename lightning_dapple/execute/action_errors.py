"""Name the schedule action an executor error happened in.

A step runs its rank's action list (``schedule/actions.py``, compiled once into ops by
``execute/runner.py``). An error raised inside it -- a layer that fails on one micro-batch's
shapes, a loss that raises, a transfer that breaks -- would otherwise point at a Python frame,
not at the place in the pipeline. Here its message is prefixed with the action in the text
form every schedule prints (``in action 1B3:``: stage 1, backward of micro-batch 3), so the
one-line report of the failing rank, and the message its peers stop with, say where the
pipeline was. Under ``DAPPLE_DEBUG=1`` the message also carries the stage's action list of
the step, the failing action marked ``>>1B3<<``.

The exception keeps its type: the failure channel and the reporting read it. A peer's
failure (``PeerFailedError``) is not renamed: it names that peer's own action already.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import debugging
from lightning_dapple.schedule.actions import Action

__all__ = ["name_action"]


def name_action(exc: BaseException, action: Action, actions: Sequence[Action], position: int) -> None:
    """Prefix ``exc``'s message with ``action`` (at ``position`` in the stage's ``actions``);
    with ``DAPPLE_DEBUG=1`` append the list, the failing action marked."""
    where = f"in action {action}"
    if debugging():
        marked = " ".join(f">>{each}<<" if index == position else each.text for index, each in enumerate(actions))
        where_long = f"\nthe step's actions on stage {action.stage}: {marked}"
    else:
        where_long = ""
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{where}: {exc.args[0]}{where_long}", *exc.args[1:])
    elif hasattr(exc, "add_note"):  # a message that is not text (e.g. OSError's errno): a note
        exc.add_note(f"{where}{where_long}")
