"""Layers that write their input in place.

A stage's input is a leaf that requires grad (received from upstream, or made by the
profiler to time a backward); autograd refuses an in-place write to a leaf, or to a view of
one. torchvision-style stacks do exactly that where a cut falls before an activation:
``nn.ReLU(inplace=True)`` becomes the first layer of a stage. Such a layer is given a copy
of its input (``execute/stage.py``, ``profile/profiler.py``), as a plain model gives it the
non-leaf output of the layer before.
"""
from __future__ import annotations

import torch.fx as fx
from torch import nn

__all__ = ["writes_input_in_place"]


def writes_input_in_place(layer: nn.Module) -> bool:
    """Whether ``layer``'s first computation writes its input in place: an ``inplace=True``
    module first in (nested) ``nn.Sequential``s, or, in a traced layer, such a module, an
    ``inplace=True`` function or an in-place method (``x.relu_()``) applied to the input."""
    first = layer
    while isinstance(first, nn.Sequential) and len(first) > 0:
        first = first[0]
    if getattr(first, "inplace", False) is True:
        return True
    if isinstance(layer, fx.GraphModule):
        return any(_writes(layer, node) for node in layer.graph.nodes if _reads_input(node))
    return False


def _reads_input(node: fx.Node) -> bool:
    """Whether ``node`` takes the layer's input (a placeholder, or an item of it)."""
    for arg in node.all_input_nodes:
        if arg.op == "placeholder" or (arg.op == "call_function" and any(a.op == "placeholder" for a in arg.all_input_nodes)):
            return True
    return False


def _writes(module: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    if node.op == "call_function":
        return node.kwargs.get("inplace") is True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    return False
