"""The user's ``training_step`` around ``self(...)``, timed at set-up: ``ModelProfile.step_glue_ms``.

A layer profile (PipeDream 3.2, DAPPLE 4.1) times the layers. The last stage does more for
every micro-batch slice: it runs the user's ``training_step`` with ``self(...)`` answered by
its layers' output (``step_callbacks.TrainCallbacks``), so the criterion, the metrics and
the ``self.log`` calls after the call run once per slice. On small models that is a sizeable
part of the last stage's forward, and it grows with M, which a profile of the layers alone
does not show. Set-up runs the layers on two sample rows anyway (``pipeline_setup``'s check
that ``forward`` is the layer list); the step is timed on those rows with that output, its
logs recorded and dropped, its metrics and the random stream put back, and the cost model
adds it to the last stage's forward (``plan/costs.py``).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

from lightning.pytorch import LightningModule

from lightning_dapple.strategy.metric_states import MetricStates
from lightning_dapple.strategy.module_adapter import LogRecorder, forward_replaced

__all__ = ["step_glue_ms"]


def step_glue_ms(module: LightningModule, batch: Any, output: Any, traced_inputs: Sequence[str] | None = None, repeats: int = 5) -> float:
    """Median milliseconds of ``module.training_step(batch, 0)`` with ``self(...)`` answering
    ``output`` (one untimed call first); 0.0 where the step fails outside training (the run
    then reports it from the real step)."""
    metrics = MetricStates(module)
    times = []
    try:
        for _ in range(repeats + 1):
            with forward_replaced(module, lambda *args: output, traced_inputs), LogRecorder().recording(module, 1.0):
                start = time.perf_counter()
                module.training_step(batch, 0)
                times.append((time.perf_counter() - start) * 1e3)
    except Exception:  # the step needs what only training gives it; the glue is then not priced
        return 0.0
    finally:
        metrics.restore()
    return statistics.median(times[1:])
