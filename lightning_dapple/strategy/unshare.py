"""Module tensors that a ``spawn`` launch shares between ranks, made each rank's own.

``torch.multiprocessing`` pickles a CPU tensor sent to a spawned process into shared memory,
so under ``start_method="spawn"`` (and ``"forkserver"``) every rank receives the same storage
for every tensor of the LightningModule. Lightning copies the parameters and buffers of the
modules it passes (``_disable_module_memory_sharing``, under ``spawn`` on the CPU), but not
the other tensors a module holds: a torchmetrics metric's states (``add_state``) and any
tensor attribute. Those stay one storage for all ranks. Each rank's in-place update then
lands in every rank's metric, in an order set by timing, and the metric's own sync at
``compute()`` adds the ranks' identical states once more: a ``SumMetric`` reads twice the
sum on two ranks, and a float32 mean varies in its last bit from run to run. Plain
Lightning's ``ddp_spawn`` on the CPU does the same.

``unshare_run_tensors`` gives a rank its own copy of each shared CPU tensor before training
starts, in the LightningModule and in what its callbacks hold (a metric, a counter, an
averaged copy of the weights): the tensors in a module's or callback's attributes, directly
or inside a list, tuple or dict (metric states, their defaults), and, when the rank trains
on the CPU, the parameters and buffers (``.data`` replaced, so the ``Parameter`` objects stay
the ones the user's code holds; Lightning copies them only under ``spawn``, not
``forkserver``). A rank training on a GPU leaves its weights shared: it moves its own stage
to the device, and a host copy of the whole model per rank would cost the memory a pipeline
saves. A CUDA tensor is left alone (``is_shared`` is always true there); data loaders are
not touched (read-only, shared on purpose).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["unshare_module_tensors", "unshare_run_tensors"]

_MODULE_TABLES = ("_parameters", "_buffers", "_modules")  # nn.Module's own registries


def _shared(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_shared()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(tensor.requires_grad)


def _own(value: Any) -> tuple[Any, int]:
    """``value`` with each shared CPU tensor in it (itself, or an item of a list, tuple or
    dict) replaced by a private copy, and how many were copied. Lists and dicts are changed
    in place, as code holding them expects."""
    if _shared(value):
        return _copy(value), 1
    copied = 0
    if isinstance(value, (list, dict)):
        for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
            if _shared(item):
                value[key] = _copy(item)
                copied += 1
    elif isinstance(value, tuple) and any(_shared(item) for item in value):
        items = [_copy(item) if _shared(item) else item for item in value]
        copied = sum(1 for item in value if _shared(item))
        value = type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value, copied


def _own_attributes(holder: Any, skip: tuple[str, ...] = ()) -> int:
    """``_own`` of each attribute of ``holder`` (none for an object without ``__dict__``),
    a replaced tensor or tuple written back; how many tensors were copied."""
    attributes = getattr(holder, "__dict__", {})
    copied = 0
    for name, value in list(attributes.items()):
        if name in skip:
            continue
        owned, count = _own(value)
        if owned is not value:
            attributes[name] = owned
        copied += count
    return copied


@torch.no_grad()
def unshare_module_tensors(module: nn.Module, weights: bool = True) -> int:
    """Give this process its own copy of every shared CPU tensor ``module`` and its
    submodules hold (module docstring), the parameters and buffers only with ``weights``;
    returns how many were copied."""
    copied = 0
    for sub in module.modules():
        for tensor in (*sub._parameters.values(), *sub._buffers.values()) if weights else ():
            if _shared(tensor):
                tensor.data = tensor.data.clone()
                copied += 1
        copied += _own_attributes(sub, skip=_MODULE_TABLES)
    return copied


def unshare_run_tensors(module: nn.Module, callbacks: Iterable[Any], weights: bool) -> int:
    """``unshare_module_tensors`` of the LightningModule and of every module a callback
    holds (their parameters and buffers with ``weights``: a rank training on the CPU), and a
    private copy of each shared tensor a callback holds in an attribute (directly or in a
    list, tuple or dict); returns how many were copied."""
    copied = unshare_module_tensors(module, weights)
    for callback in callbacks:
        held = getattr(callback, "__dict__", {}).values()
        copied += sum(unshare_module_tensors(value, weights) for value in held if isinstance(value, nn.Module))
        copied += _own_attributes(callback)  # a module attribute is no tensor or container: left as is
    return copied
