"""The user's step around the layers, per micro-batch: ``step_glue_ms``.

A layer profile (PipeDream 3.2, DAPPLE 4.1) times the layers alone, from the input of the
first to the output of the last. A LightningModule's ``training_step`` does more on every
micro-batch: before ``self(...)`` it unpacks the batch and builds the input; after it, it
computes the loss (often a cross-entropy over a vocabulary) and calls ``self.log``. The
executor runs that code on the first stage (up to ``self(...)``, to make the input) and on
the last (the whole step, with ``self(...)`` answered by the pipeline's output), so the
first stage's F and the last stage's F and B are longer than the layers' compute by a
fixed amount that the cost model (``plan/costs.py``) must add there, and only there.

``StepGlue`` holds that amount, in milliseconds per micro-batch, as measured at set-up on
the run's own step (``strategy/glue_probe.py``):

* ``input``: the step up to its ``self(...)`` call (first stage, in F, where the stage is
  not also the last);
* ``loss_forward``: the whole step with ``self(...)`` answered at once (last stage, in F):
  the code before the call again, the loss and the logging;
* ``loss_backward``: the loss's backward down to the model output (last stage, in B, and
  in I when the stage defers its weight gradients).

It is a fixed cost per call, not scaled with the slice's rows: what it times is mostly
Python and the logging, and a loss whose work grows with the rows is a small part of it at
the sizes the probe sees. A profile without it (written before it existed, taken by
``dapple-profile`` without a LightningModule, or of a model built on the meta device) has
none: all zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_dapple.profile.milliseconds import MsTable, ms_table

__all__ = ["GLUE_PARTS", "NO_GLUE", "StepGlue", "glue_from_dict"]

# JSON key -> field
GLUE_PARTS = {"input": "input", "loss_forward": "loss_forward", "loss_backward": "loss_backward"}


@dataclass(frozen=True)
class StepGlue(MsTable):
    """Milliseconds per micro-batch of the user's step around the layers (module docstring).
    All zero: nothing is charged."""

    JSON_NAME = "step_glue_ms"
    KEYS = GLUE_PARTS
    FIX = "write milliseconds per micro-batch"

    input: float = 0.0
    loss_forward: float = 0.0
    loss_backward: float = 0.0

    def forward_ms(self, first: bool, last: bool) -> float:
        """What a stage's F adds per micro-batch: the input on the first stage, the loss on
        the last. A stage that is both runs the step once, whole (``loss_forward``, which
        holds the code before ``self(...)`` too), and makes no input apart."""
        if last:
            return self.loss_forward
        return self.input if first else 0.0

    def backward_ms(self, last: bool) -> float:
        """What a stage's B (or I) adds per micro-batch: the loss's backward on the last."""
        return self.loss_backward if last else 0.0


NO_GLUE = StepGlue()


def glue_from_dict(data: Any, source: str = "step_glue_ms") -> StepGlue:
    """The JSON form (``{"input": ms, "loss_forward": ms, "loss_backward": ms}``; a part left
    out costs 0) as a ``StepGlue``; unknown parts are refused."""
    return StepGlue(**ms_table(data, GLUE_PARTS, source, "part", "write milliseconds per micro-batch"))
