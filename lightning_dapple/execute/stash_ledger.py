"""Stashed bytes of one rank's step: what each in-flight micro-batch holds, and how it is sized.

DAPPLE's memory argument (3.2, 5.3) is the activations each in-flight micro-batch keeps from
its forward until its backward; out-of-order backprop (ooo-backprop sec. 3) adds the output
gradients a pending W keeps, and recomputation (gpipe.txt 2.3) replaces a micro-batch's stash
by its kept stage input until the replay before its B. The executor follows the planner's rule
(``schedule.ooo.stash_walk``) with measured sizes, through two collaborators:

* ``StashLedger``: the accounting. The runner charges a micro-batch's bytes when its F (or
  the replay before its B, or the B that leaves output gradients to W) stashes them and drops
  them when the last of its work is done; the ledger keeps the bytes per micro-batch, the
  step's peak and the most micro-batches in flight at once.
* ``StashSizes``: the sizes. Saved-tensor hooks (``profile/stash.py``) cost Python work on
  every saved tensor, so they run in the first step of each layout only -- (batch rows,
  training): what a forward saves depends on the layout of its input, not on its values --
  and the steps after it reuse the sizes. ``StashSizes.for_step`` answers with a
  ``MeasuringSizes`` or a ``KnownSizes``; both have the same methods, so the runner's handlers
  never ask which one they have.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from lightning_dapple.execute.replay import tensor_bytes
from lightning_dapple.profile.stash import StashMeter, parameter_storages

__all__ = ["StashLedger", "StashSizes", "StepSizes", "MeasuringSizes", "KnownSizes"]

Layout = tuple[int, bool]  # (batch rows, training)


class StashLedger:
    """Bytes each in-flight micro-batch holds in one step, and the step's peaks."""

    __slots__ = ("held", "stash_bytes", "peak_stash_bytes", "peak_in_flight")

    def __init__(self) -> None:
        self.held: dict[int, int] = {}
        self.stash_bytes: dict[int, int] = {}  # per micro-batch: what its F stashed
        self.peak_stash_bytes = 0
        self.peak_in_flight = 0

    def start(self) -> None:
        """Begin a step: nothing held. ``stash_bytes`` is a new dict (a step's stats keep theirs)."""
        self.held = {}
        self.stash_bytes = {}
        self.peak_stash_bytes = 0
        self.peak_in_flight = 0

    def forwarded(self, microbatch: int, nbytes: int) -> None:
        """The F of ``microbatch`` stashed ``nbytes``: it is in flight until ``drop``."""
        self.stash_bytes[microbatch] = nbytes
        self.hold(microbatch, nbytes)
        self.peak_in_flight = max(self.peak_in_flight, len(self.held))

    def hold(self, microbatch: int, nbytes: int) -> None:
        """``microbatch`` holds ``nbytes`` more (a replay's stash, a pending W's gradients)."""
        self.held[microbatch] = self.held.get(microbatch, 0) + nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, sum(self.held.values()))

    def drop(self, microbatch: int) -> None:
        """The last work of ``microbatch`` on this stage is done: it holds nothing more."""
        self.held.pop(microbatch, None)


class StepSizes:
    """One step's stash sizes: measured (first step of a layout) or reused (the steps after).

    ``meter()`` is the ``StashMeter`` a stashing forward runs under, or None where sizes are
    already known; ``saved``, ``kept`` and ``replayed`` answer the bytes of a micro-batch's
    forward stash, its kept input (recomputed micro-batches) and its replay's stash.
    """

    __slots__ = ("forward", "replay")

    def __init__(self, forward: dict[int, int], replay: dict[int, int]) -> None:
        self.forward = forward
        self.replay = replay

    def meter(self) -> StashMeter | None:
        raise NotImplementedError

    def saved(self, microbatch: int, meter: StashMeter | None) -> int:
        raise NotImplementedError

    def kept(self, microbatch: int, inputs: Any) -> int:
        """Bytes of the stage input a recomputed micro-batch keeps instead of its stash."""
        nbytes = self.forward.get(microbatch)
        if nbytes is None:  # measured in the first step of a layout only
            nbytes = self.forward[microbatch] = tensor_bytes(inputs)
        return nbytes

    def replayed(self, microbatch: int, meter: StashMeter | None) -> int:
        raise NotImplementedError

    def finish(self) -> None:
        """The step ran to its end: keep what it measured."""


class MeasuringSizes(StepSizes):
    """The first step of a layout: every stashing forward runs under a meter."""

    __slots__ = ("_exclude", "_keep")

    def __init__(self, exclude: set[int], keep: Callable[[StepSizes], None]) -> None:
        super().__init__({}, {})
        self._exclude = exclude
        self._keep = keep

    def meter(self) -> StashMeter:
        return StashMeter(self._exclude)

    def saved(self, microbatch: int, meter: StashMeter | None) -> int:
        assert meter is not None
        nbytes = self.forward[microbatch] = meter.bytes
        return nbytes

    def replayed(self, microbatch: int, meter: StashMeter | None) -> int:
        assert meter is not None
        nbytes = self.replay[microbatch] = meter.bytes
        return nbytes

    def finish(self) -> None:
        self._keep(KnownSizes(self.forward, self.replay))


class KnownSizes(StepSizes):
    """A later step of a layout: the sizes its first step measured, no hooks."""

    __slots__ = ()

    def meter(self) -> None:
        return None

    def saved(self, microbatch: int, meter: StashMeter | None) -> int:
        return self.forward.get(microbatch, 0)

    def replayed(self, microbatch: int, meter: StashMeter | None) -> int:
        return self.replay.get(microbatch, 0)


class StashSizes:
    """Stash sizes per layout (batch rows, training), measured once each."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self._parameters = list(parameters)
        self._known: dict[Layout, KnownSizes] = {}

    def for_step(self, layout: Layout) -> StepSizes:
        """The sizes of a step of ``layout``: known ones, or a measurement kept when the step
        finishes (a step that fails measures again next time)."""
        known = self._known.get(layout)
        if known is not None:
            return known

        def keep(sizes: StepSizes) -> None:
            self._known[layout] = sizes  # type: ignore[assignment]

        # parameters are saved by reference, not stashed: leave their storages out
        return MeasuringSizes(parameter_storages(self._parameters), keep)
