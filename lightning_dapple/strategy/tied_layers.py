"""Freeing the other stages' layers without touching what this stage shares with them.

Each rank keeps its stage's layers and moves the others to the meta device (structure
kept, memory released). A layer may use a tensor a kept layer also uses (a tied weight:
the output projection is the token embedding), or share a whole sub-module with it.
Whether ``Module.to("meta")`` then leaves the kept layer's tensor alone depends on how
torch converts parameters: by default it gives the converted module a new Parameter, but
with ``torch.__future__.set_swap_module_params_on_conversion(True)`` it swaps the
tensor's contents in place, and a shared sub-module is converted for both layers either
way. ``free_layer`` therefore first gives the freed layer meta stand-ins of everything it
shares with the kept layers, so the kept copy stays as it is whatever the setting; the
tie between the two stages is then the executor's to keep (``execute/tied.py``: their
gradients are summed over both). ``retie`` puts the ties back once a rank holds every
layer again (rank 0 after ``fit``).
"""
from __future__ import annotations

import copy
from typing import Iterable, Sequence

import torch
from torch import nn

from lightning_dapple.profile.ties import TiedParameter

__all__ = ["KeptTensors", "free_layer", "retie"]


class KeptTensors:
    """What the kept layers hold (by identity): their tensors and their sub-modules."""

    def __init__(self, kept: Iterable[nn.Module]) -> None:
        self.tensors: set[int] = set()
        self.modules: set[int] = set()
        for layer in kept:
            self.modules.update(id(module) for module in layer.modules())
            self.tensors.update(id(tensor) for tensor in (*layer.parameters(), *layer.buffers()))


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_like(tensor, device="meta")
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose tensors are meta stand-ins (nothing real is copied)."""
    memo = {id(tensor): _meta_like(tensor) for tensor in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def _detach_shared_modules(module: nn.Module, kept: KeptTensors) -> None:
    for name, child in module._modules.items():
        if child is None:
            continue
        if id(child) in kept.modules:
            module._modules[name] = _meta_copy(child)
        else:
            _detach_shared_modules(child, kept)


def free_layer(layer: nn.Module, kept: KeptTensors) -> nn.Module:
    """``layer`` moved to the meta device (in place where it shares nothing with the kept
    layers); returns the skeleton that stands for it."""
    if id(layer) in kept.modules:  # the same module object is also a kept layer
        return _meta_copy(layer)
    _detach_shared_modules(layer, kept)
    for module in layer.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and id(tensor) in kept.tensors:
                    table[name] = _meta_like(tensor)
    return layer.to("meta")


def _set_parameter(layer: nn.Module, name: str, param: nn.Parameter) -> None:
    path, _, attribute = name.rpartition(".")
    owner = layer.get_submodule(path) if path else layer
    owner._parameters[attribute] = param


def retie(layers: Sequence[nn.Module], ties: Sequence[TiedParameter]) -> None:
    """Make every use of each tied parameter the first layer's ``nn.Parameter`` again
    (the copies hold equal values: the executor keeps them bit-identical)."""
    for tie in ties:
        first, name = tie.uses[0]
        param = layers[first].get_parameter(name)
        for index, use in tie.uses[1:]:
            _set_parameter(layers[index], use, param)
