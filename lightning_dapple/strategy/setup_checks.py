"""Checks ``setup`` runs before any stage is made: what the pipeline cannot run as asked is refused
with one line naming the fix.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.plan import Plan


def run_or_explain(call: Callable[[], Any], what: str, args: tuple, step_name: str, path: str) -> Any:
    """Run one part of the forward check; a failure becomes one line naming what broke."""
    try:
        return call()
    except Exception as exc:
        problem = f"failed on the sample batch ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        if len(args) > 1:
            raise DappleConfigError(
                what,
                f"{problem}: {step_name} calls self(...) with {len(args)} positional arguments, and the pipeline hands "
                f"them to layer 0 of '{path}' as one tuple",
                f"call self(x) with layer 0's one input and use the other values in {step_name} "
                "(e.g. loss = criterion(self(inputs), target)), or make layer 0 take the tuple",
            ) from None
        raise DappleConfigError(
            what, problem, f"make forward(x) apply the layers of '{path}' in order, each taking what the previous one returned"
        ) from None


def output_leaves(value: Any) -> list[Any]:
    """The values in a forward output, in order, through tuples, lists, mappings (a Hugging
    Face ``ModelOutput`` is an OrderedDict) and dataclasses, which pytree leaves whole. A
    Hugging Face key/value cache (``past_key_values`` when ``config.use_cache``) is state for
    generation, not a value the step trains on; the pipeline's layers keep none."""
    if type(value).__module__.startswith("transformers.cache_utils"):
        return []
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in output_leaves(item)]
    if isinstance(value, Mapping):
        return [leaf for key in value for leaf in output_leaves(value[key])]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [leaf for field in dataclasses.fields(value) for leaf in output_leaves(getattr(value, field.name))]
    return [value]


def check_callbacks(trainer: Trainer, plan: Plan) -> None:
    """Callbacks that need the whole model on every rank: ``StochasticWeightAveraging`` copies
    the module when it is set up, before the stages are freed, and then pairs the copy's
    parameters with ``self.parameters()``, which on a pipeline are one stage's."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    if plan.num_stages > 1 and any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):
        raise DappleConfigError(
            "StochasticWeightAveraging",
            f"averages a copy of the whole model, but on this {plan.num_stages}-stage plan each rank's module holds one "
            "stage's parameters",
            "train on a single-stage plan (data parallelism) with it, or average the weights after training "
            "(torch.optim.swa_utils.AveragedModel over the checkpoints rank 0 writes)",
        )


def check_module(module: LightningModule) -> None:
    """What the pipeline cannot run as the module asks, refused before anything is set up."""
    require(
        module.automatic_optimization,
        "automatic_optimization",
        "is off; manual optimization is not supported by the pipeline",
        "use automatic optimization (the default)",
    )
    require(
        not is_overridden("backward", module),
        f"{type(module).__name__}.backward",
        "is overridden, but the pipeline runs every micro-batch's backward itself, inside the step, so it would never run",
        "put what it does into the loss training_step returns (a scale, an extra term), or into on_after_backward",
    )
    require(
        getattr(module, "_compiler_ctx", None) is None,
        "the model",
        "was compiled whole (trainer.fit(torch.compile(model))): Lightning then runs forward and every step as compiled "
        "programs, but the pipeline runs the step's forward as stages on several processes, which one compiled program "
        "cannot span",
        "compile the blocks instead, e.g. `for i, block in enumerate(self.blocks): self.blocks[i] = torch.compile(block)` "
        "in __init__ or configure_model, and pass the LightningModule itself to fit",
    )
