"""Parameters that several layers of a sequence use: tied weights.

GPT-2, BERT's MLM head and T5 use the token embedding's matrix again as the output
projection, so layer 0 and the last layer hold one ``nn.Parameter``. Pipelined, those
layers land on different stages; each stage then keeps a copy (Megatron's embedding
group and DeepSpeed's ``TiedLayerSpec`` do the same), which the planner must count in the
memory of every stage holding one and whose gradients the executor must sum over all of
them (``execute/tied.py``). This module finds the ties in a layer list, by parameter
identity, once, before anything is split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import nn

from lightning_dapple.profile.model_profile import TiedParams

__all__ = ["TiedParameter", "tied_parameters", "first_use_param_bytes", "tied_params_records"]


@dataclass(frozen=True)
class TiedParameter:
    """One parameter used by more than one layer of the sequence.

    ``uses`` are (layer index, the parameter's name inside that layer), in layer order; a
    layer that reaches the parameter by two names lists both.
    """

    uses: tuple[tuple[int, str], ...]
    param_bytes: int

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers using the parameter, ascending, each once."""
        return tuple(sorted({index for index, _ in self.uses}))

    @property
    def owner(self) -> int:
        """The first layer using it: the one whose ``param_bytes`` counts it."""
        return self.layers[0]

    def name_in(self, layer: int) -> str:
        """The parameter's (first) name inside ``layer``."""
        return next(name for index, name in self.uses if index == layer)


def _uses(layers: Sequence[nn.Module]) -> dict[int, tuple[nn.Parameter, list[tuple[int, str]]]]:
    found: dict[int, tuple[nn.Parameter, list[tuple[int, str]]]] = {}
    for index, layer in enumerate(layers):
        for name, param in layer.named_parameters(remove_duplicate=False):
            found.setdefault(id(param), (param, []))[1].append((index, name))
    return found


def tied_parameters(layers: Sequence[nn.Module]) -> tuple[TiedParameter, ...]:
    """The parameters of ``layers`` that more than one layer uses, in order of first use."""
    ties = []
    for param, uses in _uses(layers).values():
        if len({index for index, _ in uses}) > 1:
            ties.append(TiedParameter(tuple(uses), param.numel() * param.element_size()))
    return tuple(ties)


def first_use_param_bytes(layers: Sequence[nn.Module]) -> list[float]:
    """Per layer, the bytes of the parameters it is the first layer to use: a tied
    parameter counts once, in its first layer, so the sum is the model's parameter size."""
    sizes = [0.0] * len(layers)
    for param, uses in _uses(layers).values():
        sizes[uses[0][0]] += float(param.numel() * param.element_size())
    return sizes


def tied_params_records(ties: Sequence[TiedParameter]) -> tuple[TiedParams, ...]:
    """The profile's ``tied`` entries: one per set of layers sharing parameters, with
    their bytes summed (a tied weight and bias move and sync together)."""
    merged: dict[tuple[int, ...], tuple[float, list[str]]] = {}
    for tie in ties:
        total, names = merged.get(tie.layers, (0.0, []))
        merged[tie.layers] = (total + tie.param_bytes, [*names, f"{tie.owner}.{tie.name_in(tie.owner)}"])
    return tuple(TiedParams(layers, total, tuple(names)) for layers, (total, names) in merged.items())
