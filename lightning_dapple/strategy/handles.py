"""Other paths to the layers: handles, and the tensors a traced layer list reads from forward.

Each rank keeps one stage's layers and frees the rest (``DappleStrategy._prepare_pipeline``
moves them to the meta device and puts a ``FreedLayer`` in their place in the layer
sequence). A module can reach a layer, or a part of one, by another path too:
``self.head = self.layers[-1]``, ``self.attn0 = self.layers[0].attn``, a parameter
registered twice, or, for a layer list traced from ``forward`` (``profile/traced_layers``),
the module's own children and the parameters ``forward`` reads (``x + self.pos_emb``).
Left alone, those paths would carry meta tensors into ``model_to_device`` ("Cannot copy
out of meta tensor") or another stage's stale copy into the checkpoint.

So, before the layers are freed, every other path to another stage's modules is pointed
at a ``FreedLayer`` and every other slot holding another stage's tensor is emptied; the
checkpoint keys of those paths are then held by the owning stage only, as the layer's
own keys are. After training, rank 0 rebuilds the freed layers (``LayerTensors.rebuild``)
and puts every path back, so each points at the same object as before and the module is
whole again, ties between paths included.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator

import torch
from torch import nn

from lightning_dapple.strategy.module_adapter import FreedLayer

__all__ = ["Detached", "LayerTensors"]

_KINDS = ("_parameters", "_buffers")


def _slots(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    for kind in _KINDS:
        for name, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield kind, name, tensor


@dataclass
class Detached:
    """The paths emptied on this rank: (parent, name, module) references and (module,
    slot kind, name, layer index, name in that layer) tensor slots."""

    references: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    slots: list[tuple[nn.Module, str, str, int, str]] = field(default_factory=list)

    def reattach(self, layers: nn.Module) -> None:
        """Point every path back at its module, and every slot at the (rebuilt) tensor of
        the layer that holds it, so two paths to one tensor share it again."""
        for parent, name, child in self.references:
            parent._modules[name] = child
        for module, kind, name, index, local in self.slots:
            owner = layers[index]
            getattr(module, kind)[name] = owner.get_parameter(local) if kind == "_parameters" else owner.get_buffer(local)
        self.references, self.slots = [], []


@dataclass(frozen=True)
class LayerTensors:
    """Which layers hold each tensor and module of the model, under which names, recorded
    before any layer is freed (tensor identity, not key prefixes, decides)."""

    keys: list[dict[str, str]]  # per layer: its state-dict key -> the module's key
    transient: list[dict[str, torch.Tensor]]  # per layer: buffers outside the checkpoint (copies, rank 0 only)
    _owners: dict[int, tuple[Any, frozenset[int], int, str]]  # id -> (weakref, layers, first layer, name there)
    _modules: dict[int, tuple[Any, int]]  # id -> (weakref, a layer holding the module)

    @classmethod
    def of(cls, module: nn.Module, layers: nn.Module, keep_transient: bool) -> "LayerTensors":
        module_key = {id(value): key for key, value in reversed(list(module.state_dict(keep_vars=True).items()))}
        owners: dict[int, tuple[Any, frozenset[int], int, str]] = {}
        modules: dict[int, tuple[Any, int]] = {}
        keys, transient = [], []
        for index, layer in enumerate(layers):
            state = layer.state_dict(keep_vars=True)
            keys.append({local: module_key[id(value)] for local, value in state.items() if id(value) in module_key})
            # buffers no checkpoint holds (non-persistent ones; a traced layer's copies of them)
            transient.append({name: b.detach().clone() for name, b in layer.named_buffers() if keep_transient and id(b) not in module_key})
            for local, tensor in (*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)):
                ref, holders, first, name = owners.get(id(tensor), (weakref.ref(tensor), frozenset(), index, local))
                owners[id(tensor)] = (ref, holders | {index}, first, name)
            for part in layer.modules():
                modules.setdefault(id(part), (weakref.ref(part), index))
        return cls(keys, transient, owners, modules)

    def _owner(self, tensor: torch.Tensor) -> tuple[frozenset[int], int, str] | None:
        entry = self._owners.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1], entry[2], entry[3]

    def _layer_of(self, part: nn.Module, kept: set[int]) -> int | None:
        entry = self._modules.get(id(part))
        if entry is None or entry[0]() is not part or id(part) in kept:
            return None
        return entry[1]

    def detach(self, module: nn.Module, layers: nn.Module, held: Collection[int], stage_of: Callable[[int], int]) -> Detached:
        """Empty, in ``module``, every path to a module or tensor of a layer outside
        ``held`` (this rank's layers: its stage's, or its chunks') other than the layer
        sequence's own entries (which the caller frees)."""
        mine = set(held)
        kept = {id(part) for index in mine for part in layers[index].modules()}
        detached = Detached()
        seen: set[int] = {id(layers)}
        stack = [module]
        while stack:
            parent = stack.pop()
            for kind, name, tensor in list(_slots(parent)):
                owner = self._owner(tensor)
                if owner is not None and not owner[0] & mine:
                    getattr(parent, kind)[name] = None
                    detached.slots.append((parent, kind, name, owner[1], owner[2]))
            for name, child in list(parent._modules.items()):
                if child is None or id(child) in seen:
                    continue
                index = self._layer_of(child, kept)
                if index is not None and index not in mine:
                    parent._modules[name] = self._stand_in(child, FreedLayer(index, stage_of(index)), mine)
                    detached.references.append((parent, name, child))
                    continue
                seen.add(id(child))
                stack.append(child)
        return detached

    def _stand_in(self, child: nn.Module, freed: FreedLayer, mine: set[int]) -> FreedLayer:
        """``freed`` in place of another stage's module, holding, under their own names,
        those of its tensors that a layer of this rank uses too: a weight read from
        ``forward`` (``F.linear(h, self.wte.weight)``) is a tie between the module's layer
        and the reading one, and this rank's copy must stay a parameter of the module, so
        that ``configure_optimizers`` steps it with the gradient the tie sums."""
        for prefix, part in child.named_modules():
            for kind, name, tensor in _slots(part):
                owner = self._owner(tensor)
                if owner is None or not owner[0] & mine:
                    continue
                holder: nn.Module = freed
                for step in (prefix.split(".") if prefix else []):
                    if step not in holder._modules:
                        holder._modules[step] = nn.Module()
                    holder = holder._modules[step]
                getattr(holder, kind)[name] = tensor
        return freed

    def rebuild(self, skeleton: nn.Module, index: int, state: dict[str, Any]) -> nn.Module:
        """A freed layer (a meta-device skeleton) made whole on the CPU from the module's
        consolidated state dict."""
        layer = skeleton.to_empty(device="cpu")
        missing, unexpected = layer.load_state_dict({local: state[key] for local, key in self.keys[index].items()}, strict=False)
        assert not unexpected and set(missing) <= set(self.transient[index]), (missing, unexpected)
        for name, value in self.transient[index].items():
            layer.get_buffer(name).copy_(value)
        return layer
