"""Options of Lightning's ``DDPStrategy`` that the dapple strategy refuses, each with what it
does instead.

``DappleStrategy`` reuses ``DDPStrategy`` for launching and process-group set-up, but never
wraps the model in ``DistributedDataParallel``: it runs the plan's schedule itself, and each
replicated stage sums its gradients in its own bucketed AllReduce (DAPPLE 5.2.3,
``execute/grad_sync.py``). Keywords that ``DDPStrategy`` would hand to DDP (or to its
communication hooks and model averaging) would be accepted and silently ignored, so they
are refused before anything starts, like every other piece of bad input.

A DDP option at its default (``DDPStrategy.__init__``'s, or ``DistributedDataParallel``'s
for the ones ``DDPStrategy`` hands on) asks for nothing and is accepted and dropped: config
systems that fill in every inherited argument (LightningCLI's jsonargparse, a Hydra
``_target_`` with a full argument list) write them all out. Only a value the user changed
is refused.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_dapple.errors import DappleConfigError

__all__ = ["PASSED_TO_LIGHTNING", "ddp_defaults", "refuse_ddp_options"]

#: ``DDPStrategy``/``ParallelStrategy`` arguments that keep their meaning under dapple
PASSED_TO_LIGHTNING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "process_group_backend")

_NO_REDUCER = "each replicated stage sums its gradients in its own bucketed AllReduce (execute/grad_sync.py), which takes no hook"

#: what the dapple strategy does instead of each DDP option
INSTEAD = {
    "timeout": "the dapple strategy takes timeout_s (seconds), the bound on every wait and the process group's timeout",
    "ddp_comm_hook": _NO_REDUCER,
    "ddp_comm_state": _NO_REDUCER,
    "ddp_comm_wrapper": _NO_REDUCER,
    "model_averaging_period": "the replicas of a stage all-reduce their gradients every step, so their weights never diverge and there is nothing to average",
    "find_unused_parameters": "a parameter that gets no gradient in a step is all-reduced as a zero gradient; there is nothing to find",
    "static_graph": "the schedule is compiled once per plan and every step runs the same action list",
    "gradient_as_bucket_view": "gradients are copied into their bucket for its AllReduce and the sums copied back",
    "bucket_cap_mb": "gradient buckets are the planner's (plan/buckets.py), the size its latency model prices",
    "bucket_cap_mb_list": "gradient buckets are the planner's (plan/buckets.py), the size its latency model prices",
    "mixed_precision": "mixed precision is Lightning's: Trainer(precision='bf16-mixed' or '16-mixed')",
    "process_group": "the strategy builds its process groups from the plan (one per replicated stage)",
    "device_mesh": "the strategy builds its process groups from the plan (one per replicated stage)",
}

#: DistributedDataParallel's other keywords: none has an effect without the DDP wrapper
_DDP_ONLY = (
    "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync", "check_reduction", "delay_all_reduce_named_params",
    "param_to_hook_all_reduce", "skip_all_reduce_unused_params", "batched_grad_copy", "forward_sync_buffers",
)


@lru_cache(maxsize=1)
def ddp_defaults() -> dict[str, Any]:
    """Each DDP option's default: ``DDPStrategy.__init__``'s, then ``DistributedDataParallel``'s
    for the keywords ``DDPStrategy`` hands on to the wrapper."""
    defaults: dict[str, Any] = {}
    for function in (DistributedDataParallel.__init__, DDPStrategy.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults[name] = parameter.default
    return defaults


def _at_default(name: str, value: Any) -> bool:
    defaults = ddp_defaults()
    if name not in defaults:
        return False
    default = defaults[name]
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # a value whose == raises or is not a bool is not the default
        return False


def refuse_ddp_options(kwargs: dict[str, Any]) -> None:
    """Raise ``DappleConfigError`` for the first keyword the dapple strategy would ignore.

    DDP options equal to their defaults are removed from ``kwargs`` (they ask for nothing);
    Lightning's pass-through arguments stay."""
    for name in [name for name in kwargs if name not in PASSED_TO_LIGHTNING and _at_default(name, kwargs[name])]:
        del kwargs[name]
    for name in kwargs:
        if name in PASSED_TO_LIGHTNING:
            continue
        if name in INSTEAD:
            raise DappleConfigError(f"DappleStrategy({name}=...)", f"is a DDP option that would do nothing: {INSTEAD[name]}", f"remove {name}")
        if name in _DDP_ONLY:
            raise DappleConfigError(
                f"DappleStrategy({name}=...)",
                "is a DistributedDataParallel option that would do nothing: the dapple strategy does not wrap the model in DDP; "
                f"it runs the plan's schedule itself, and {_NO_REDUCER}",
                f"remove {name}",
            )
        raise DappleConfigError(
            f"DappleStrategy({name}=...)",
            "is not an argument of the dapple strategy",
            "remove it (see help(DappleStrategy) for the arguments; Lightning's "
            f"{', '.join(PASSED_TO_LIGHTNING)} pass through)",
        )
