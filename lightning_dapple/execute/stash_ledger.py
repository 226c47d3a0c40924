"""Stashed bytes of one rank's step: what each in-flight micro-batch holds, and how it is sized.

DAPPLE's memory argument (3.2, 5.3) is the activations each in-flight micro-batch keeps from
its forward until its backward; out-of-order backprop (ooo-backprop sec. 3) adds the output
gradients a pending W keeps, and recomputation (gpipe.txt 2.3) replaces a micro-batch's stash
by its kept stage input until the replay before its B. The executor follows the planner's rule
(``schedule.actions.stash_walk``) with measured sizes, through two collaborators:

* ``StashLedger``: the accounting. The runner charges a micro-batch's bytes when its F (or
  the replay before its B) stashes them; a split backward (I) frees the micro-batch's graph
  and leaves only what its W work keeps (each deferred module's input and output gradient,
  ``WeightGradStore.held_bytes``), so the micro-batch is charged exactly that from then on,
  and after each partial W what is still pending; the last of its work drops it. The
  ledger keeps the bytes per micro-batch, the step's peak and the most micro-batches in
  flight at once.
* ``StashSizes``: the sizes. Saved-tensor hooks (``profile/stash.py``) cost Python work on
  every saved tensor, so they run in the first step of each layout only -- (batch rows,
  training): what a forward saves depends on the layout of its input, not on its values --
  and the steps after it reuse the sizes. ``StashSizes.for_step`` answers with a
  ``MeasuringSizes`` or a ``KnownSizes``; both run a stashing forward the same way (the
  measuring one under a meter), so the runner's handlers never ask which one they have.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from lightning_dapple.execute.replay import tensor_bytes
from lightning_dapple.profile.stash import StashMeter, parameter_storages

__all__ = ["StashLedger", "StageSlots", "StashSizes", "StepSizes", "MeasuringSizes", "KnownSizes"]

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
        held = self.held
        held[microbatch] = held.get(microbatch, 0) + nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, sum(held.values()))
        self.peak_in_flight = max(self.peak_in_flight, len(held))

    def hold(self, microbatch: int, nbytes: int) -> None:
        """``microbatch`` holds ``nbytes`` more (a replay's stash, a pending W's gradients)."""
        self.held[microbatch] = self.held.get(microbatch, 0) + nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, sum(self.held.values()))

    def keep_only(self, microbatch: int, nbytes: int) -> None:
        """``microbatch`` now holds ``nbytes`` in all (its graph freed by a split backward,
        what its pending W work keeps is left); the peak was taken before."""
        self.held[microbatch] = nbytes
        self.peak_stash_bytes = max(self.peak_stash_bytes, sum(self.held.values()))

    def drop(self, microbatch: int) -> None:
        """The last work of ``microbatch`` on this stage is done: it holds nothing more."""
        self.held.pop(microbatch, None)


class StageSlots:
    """One stage's view of the ledger of a rank that holds several stages (chunks): its
    micro-batches are charged as (stage, micro-batch), so the rank's peak counts every
    chunk's stash at once, as the memory model of several stages per group does."""

    __slots__ = ("ledger", "stage")

    def __init__(self, ledger: StashLedger, stage: int) -> None:
        self.ledger = ledger
        self.stage = stage

    def forwarded(self, microbatch: int, nbytes: int) -> None:
        self.ledger.forwarded((self.stage, microbatch), nbytes)  # type: ignore[arg-type]

    def hold(self, microbatch: int, nbytes: int) -> None:
        self.ledger.hold((self.stage, microbatch), nbytes)  # type: ignore[arg-type]

    def keep_only(self, microbatch: int, nbytes: int) -> None:
        self.ledger.keep_only((self.stage, microbatch), nbytes)  # type: ignore[arg-type]

    def drop(self, microbatch: int) -> None:
        self.ledger.drop((self.stage, microbatch))  # type: ignore[arg-type]


Stashing = Callable[[int, "StashMeter | None"], Any]  # a stashing forward of one micro-batch


class StepSizes:
    """One step's stash sizes: measured (first step of a layout) or reused (the steps after).

    ``forward`` and ``replay`` run a stashing forward of a micro-batch (``Stage.forward``,
    ``Stage.recompute``) and answer the bytes it stashed, measured under a ``StashMeter`` or
    as measured before; ``kept`` answers the bytes of the stage input a recomputed
    micro-batch keeps instead.
    """

    __slots__ = ("forwards", "replays")

    def __init__(self, forwards: dict[int, int], replays: dict[int, int]) -> None:
        self.forwards = forwards
        self.replays = replays

    def forward(self, run: Stashing, microbatch: int) -> int:
        raise NotImplementedError

    def replay(self, run: Stashing, microbatch: int) -> int:
        raise NotImplementedError

    def kept(self, microbatch: int, inputs: Any) -> int:
        nbytes = self.forwards.get(microbatch)
        if nbytes is None:  # measured in the first step of a layout only
            nbytes = self.forwards[microbatch] = tensor_bytes(inputs)
        return nbytes

    def finish(self) -> None:
        """The step ran to its end: keep what it measured."""


class MeasuringSizes(StepSizes):
    """The first step of a layout: every stashing forward runs under a meter."""

    __slots__ = ("_exclude", "_keep")

    def __init__(self, exclude: set[int], keep: Callable[["KnownSizes"], None]) -> None:
        super().__init__({}, {})
        self._exclude = exclude
        self._keep = keep

    def forward(self, run: Stashing, microbatch: int) -> int:
        meter = StashMeter(self._exclude)
        run(microbatch, meter)
        nbytes = self.forwards[microbatch] = meter.bytes
        return nbytes

    def replay(self, run: Stashing, microbatch: int) -> int:
        meter = StashMeter(self._exclude)
        run(microbatch, meter)
        nbytes = self.replays[microbatch] = meter.bytes
        return nbytes

    def finish(self) -> None:
        self._keep(KnownSizes(self.forwards, self.replays))


class KnownSizes(StepSizes):
    """A later step of a layout: the sizes its first step measured, no hooks."""

    __slots__ = ()

    def forward(self, run: Stashing, microbatch: int) -> int:
        run(microbatch, None)
        return self.forwards.get(microbatch, 0)

    def replay(self, run: Stashing, microbatch: int) -> int:
        run(microbatch, None)
        return self.replays.get(microbatch, 0)


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

        def keep(sizes: KnownSizes) -> None:
            self._known[layout] = sizes

        # parameters are saved by reference, not stashed: leave their storages out
        return MeasuringSizes(parameter_storages(self._parameters), keep)
