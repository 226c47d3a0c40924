"""The run's optimizer, timed per layer for ``plan="auto"`` (``profile/optimizer_step.py``).

The planner prices each stage's optimizer step (``LayerProfile.optimizer_ms``) from the
optimizer the module trains with. ``configure_optimizers`` is called once more on rank 0
(and, under ``tune_steps``, on every rank for the trials' copies, ``plan_tuning.py``),
before Lightning calls it for the run, only to learn the optimizer's class and settings;
what it builds (optimizer and schedulers) is dropped and changes no parameter. Where that
cannot give one optimizer to copy (manual optimization with several, an optimizer whose
constructor does not take its own defaults, a ``configure_optimizers`` that fails this
early), the profile records why in ``meta["optimizer"]`` and prices no optimizer step.
"""
from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.optimizer_step import OptimizerFactory, measure_optimizer_ms, with_optimizer_ms

__all__ = ["optimizer_factory", "with_run_optimizer"]


def optimizer_factory(module: LightningModule) -> tuple[OptimizerFactory | None, str]:
    """A factory of fresh copies of the module's optimizer (class and defaults), and its
    name; or None and why there is none (module docstring)."""
    if not is_overridden("configure_optimizers", module, LightningModule):
        return None, "not measured: the module does not implement configure_optimizers"
    try:
        optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    except Exception as exc:  # the run itself will call it again and report what is wrong
        return None, f"not measured: configure_optimizers failed before training ({type(exc).__name__}: {exc})"
    if len(optimizers) != 1:
        return None, f"not measured: configure_optimizers returned {len(optimizers)} optimizers"
    template = optimizers[0]
    kind, defaults = type(template), _constructor_defaults(type(template), template.defaults)

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return kind(params, **defaults)

    try:
        make([nn.Parameter(torch.zeros(1))])
    except Exception as exc:
        return None, f"not measured: {kind.__name__}(params, **defaults) failed ({type(exc).__name__}: {exc})"
    return make, kind.__name__


def _constructor_defaults(kind: type, defaults: dict) -> dict:
    """``defaults`` less the keys ``kind``'s constructor does not take (``AdamW`` records
    ``decoupled_weight_decay``, which only its base class ``Adam`` accepts)."""
    accepted = inspect.signature(kind.__init__).parameters
    if any(item.kind is inspect.Parameter.VAR_KEYWORD for item in accepted.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in accepted}


def with_run_optimizer(profile: ModelProfile, module: LightningModule, layers: Sequence[nn.Module], device: torch.device) -> ModelProfile:
    """``profile`` with each layer's optimizer step timed on ``device`` (or none, and why,
    in ``meta["optimizer"]``)."""
    make, name = optimizer_factory(module)
    if make is None or len(layers) != len(profile.layers):
        why = name if make is None else f"not measured: {len(layers)} layers against {len(profile.layers)} profiled"
        return replace(profile, meta={**profile.meta, "optimizer": why})
    try:
        timed = with_optimizer_ms(profile, measure_optimizer_ms(layers, make, device))
    except Exception as exc:  # e.g. an optimizer whose step needs a closure
        return replace(profile, meta={**profile.meta, "optimizer": f"not measured: {name}.step() failed ({type(exc).__name__}: {exc})"})
    return replace(timed, meta={**timed.meta, "optimizer": name})
