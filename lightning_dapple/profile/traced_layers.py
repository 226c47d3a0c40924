"""The layer list found from ``forward``: the traced program cut between child-module calls.

DAPPLE's stages are runs of consecutive layers (DAPPLE 4), and DAPPLE builds each stage's
forward graph from the model's, recording the boundary tensors between stages (5.2.1). A
module that keeps no layer sequence still calls its children one after the other, and
``profile/trace.py`` records those calls and the glue between them as one graph. Here that
graph is cut into layers, and a cut's boundary tensors are the layer's outputs:

* every child-module call starts a layer of its own, so each repeated block is a layer;
* glue that yields a per-sample tensor runs as early as its inputs allow (a position
  embedding is added in the embedding's layer), other glue as late as its first use
  allows (a causal mask is built in the layer that uses it);
* plain values (sizes, dtypes, devices), and tensors made from them and from buffers
  alone (a causal mask), are recomputed in every layer that uses them, from the tensors
  they came from, so they never travel;
* a cut is kept only where every value alive across it is a tensor whose first dimension
  is the batch's: those travel between stages as the layer's output, one tensor or a
  tuple, sliced by micro-batch and replica like any layer output. Elsewhere the two
  neighbouring layers are one layer;
* a child with parameters or buffers that is called more than once makes its calls, and
  everything between them, one layer, so its tensors live in one layer;
* a parameter or buffer read by ``forward`` itself (``x + self.pos_emb``) belongs to the
  layer that reads it; one read by two layers is shared by them (tied weights).

Every layer is an ``fx.GraphModule`` over the module's own children and tensors, so the
layer list computes what ``forward`` computes, with the same parameters.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch.fx as fx
from torch import nn

from lightning_dapple.profile.hf_layers import hf_layers
from lightning_dapple.profile.trace import TracedProgram, trace_forward

__all__ = ["AUTO_LAYERS", "DEFAULT_LAYERS", "TracedLayers", "cut_program", "finds_layers_from_forward", "traced_layers"]

AUTO_LAYERS = "auto"  # DappleStrategy(layers="auto"), dapple-profile --layers auto
DEFAULT_LAYERS = "layers"


def finds_layers_from_forward(module: nn.Module, path: str) -> bool:
    """Whether the layer list is traced from ``forward``: asked for (``"auto"``), or the
    module keeps no sequence at the default ``layers``."""
    return path == AUTO_LAYERS or (path == DEFAULT_LAYERS and not hasattr(module, path))


class TracedLayers(nn.ModuleList):
    """The layers cut from a traced ``forward``, in order, with the children each calls."""

    def __init__(self, layers: Sequence[nn.Module], calls: Sequence[Sequence[str]], source: str, inputs: Sequence[str] = (), notes: Sequence[str] = ()) -> None:
        super().__init__(layers)
        self.calls = [list(names) for names in calls]
        self.source = source
        # the forward parameters the program was traced with, in order: every self(...) call
        # must pass these (the program is specialised to the others' defaults)
        self.inputs = tuple(inputs)
        self.notes = list(notes)  # printed after the layers (what setup changed to find them)

    def describe(self) -> list[str]:
        """One line per layer: index, the children it calls, its parameter count."""
        lines = [f"layer list traced from {self.source}.forward ({len(self)} layers):"]
        for index, (layer, names) in enumerate(zip(self, self.calls)):
            count = sum(p.numel() for p in layer.parameters())
            lines.append(f"  {index:>3}  {', '.join(names) or '(glue only)':<40} {count:>12,} parameters")
        return lines + [f"  note: {note}" for note in self.notes]


_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential", "cauchy", "geometric")


def _random(node: fx.Node) -> bool:
    """Whether the call draws random numbers (then each layer would draw its own)."""
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return any(word in name for word in _RANDOM)


@dataclass
class _Assignment:
    """Each value's layer (before merging), its last use, and the cuts that must go."""

    layer: dict[fx.Node, int]
    last_use: dict[fx.Node, int]
    forced: set[int]
    count: int


class _Cutter:
    """The cut rule of the module docstring applied to one traced program."""

    def __init__(self, program: TracedProgram) -> None:
        self.program = program
        self.nodes = list(program.graph_module.graph.nodes)
        self.order = {node: index for index, node in enumerate(self.nodes)}
        self.anchors = [node for node in self.nodes if node.op == "call_module"]
        self._sources: dict[fx.Node, frozenset[fx.Node]] = {}
        self._recomputable: dict[fx.Node, bool] = {}

    def scalar(self, node: fx.Node) -> bool:
        """Recomputed wherever it is used, never sent: a plain value (a size, a device), or a
        tensor that is the same for every sample and is made, without randomness, from
        such values and buffers only (a causal mask built from the sequence length)."""
        if node not in self._recomputable:
            kind = self.program.kinds.get(node.name)
            self._recomputable[node] = (
                node.op in ("call_function", "call_method")
                and kind is not None
                and (kind.scalar or (not kind.per_sample and not _random(node) and all(self._free(arg) for arg in node.all_input_nodes)))
            )
        return self._recomputable[node]

    def _free(self, node: fx.Node) -> bool:
        if node.op == "get_attr":
            value: Any = self.program.graph_module
            for part in str(node.target).split("."):
                value = getattr(value, part)
            return not isinstance(value, nn.Parameter)
        return self.scalar(node)

    def placed(self, node: fx.Node) -> bool:
        """A value computed in one layer: inputs, calls, tensor glue, and side effects."""
        if node.op in ("placeholder", "call_module"):
            return True
        return node.op in ("call_function", "call_method") and (not self.scalar(node) or not node.users)

    def sources(self, node: fx.Node) -> frozenset[fx.Node]:
        """The placed values ``node`` reads, seen through recomputed plain values and attributes."""
        if node not in self._sources:
            found: set[fx.Node] = set()
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    continue
                found.update(self.sources(arg) if self.scalar(arg) else (arg,))
            self._sources[node] = frozenset(found)
        return self._sources[node]

    def _use_layers(self, node: fx.Node, layer: dict[fx.Node, int], last: int) -> list[int]:
        uses: list[int] = []
        for user in node.users:
            if user.op == "output":
                uses.append(last)
            elif self.scalar(user) and user.users:
                uses.extend(self._use_layers(user, layer, last))
            else:
                uses.append(layer[user])
        return uses

    def assign(self) -> _Assignment:
        count = max(1, len(self.anchors))
        layer: dict[fx.Node, int] = {anchor: index for index, anchor in enumerate(self.anchors)}
        for node in self.nodes:  # as early as the inputs allow
            if node.op == "placeholder":
                layer[node] = 0
            elif node.op != "call_module" and self.placed(node):
                layer[node] = max((layer[source] for source in self.sources(node)), default=0)
        for node in reversed(self.nodes):  # what is not per-sample: as late as its first use
            if node.op in ("call_function", "call_method") and self.placed(node) and not self.program.kinds[node.name].per_sample:
                uses = self._use_layers(node, layer, count - 1)
                if uses:
                    layer[node] = min(uses)
        last_use: dict[fx.Node, int] = {}
        for node in self.nodes:
            at = count - 1 if node.op == "output" else layer.get(node)
            if at is None:
                continue
            for source in self.sources(node):
                last_use[source] = max(last_use.get(source, at), at)
        return _Assignment(layer, last_use, self._reused_cuts(), count)

    def _reused_cuts(self) -> set[int]:
        """Cuts between two calls of one child that has parameters or buffers."""
        calls: dict[str, list[int]] = {}
        for index, anchor in enumerate(self.anchors):
            calls.setdefault(str(anchor.target), []).append(index)
        forced: set[int] = set()
        root = self.program.graph_module
        for target, indices in calls.items():
            child = root.get_submodule(target)
            if len(indices) > 1 and any(True for _ in (*child.parameters(), *child.buffers())):
                forced.update(range(min(indices), max(indices)))
        return forced

    def crossing(self, plan: _Assignment, cut: int) -> list[fx.Node]:
        """The values alive across the cut after layer ``cut``, in program order."""
        alive = [node for node, at in plan.layer.items() if at <= cut < plan.last_use.get(node, -1)]
        return sorted(alive, key=self.order.__getitem__)

    def keeps(self, plan: _Assignment, cut: int) -> bool:
        alive = self.crossing(plan, cut)
        kinds = self.program.kinds
        return cut not in plan.forced and bool(alive) and all(kinds[node.name].per_sample for node in alive)


def _closure(cutter: _Cutter, members: set[fx.Node]) -> set[fx.Node]:
    """``members`` with the attributes and recomputed plain values they read."""
    out = set(members)
    stack = list(members)
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg not in out and (arg.op == "get_attr" or cutter.scalar(arg)):
                out.add(arg)
                stack.append(arg)
    return out


def _build(cutter: _Cutter, plan: _Assignment, first: int, last: int, inputs: list[fx.Node], outputs: list[fx.Node] | None) -> fx.GraphModule:
    """One layer: original layers ``first..last``; ``outputs`` None means forward's output."""
    members = {node for node, at in plan.layer.items() if first <= at <= last and node.op != "placeholder"}
    output_node = cutter.nodes[-1]
    if outputs is None:
        members.add(output_node)
    emit = _closure(cutter, members)
    graph = fx.Graph()
    x = graph.placeholder("x")
    unpack = len(inputs) > 1 or (first == 0 and cutter.program.num_inputs > 1)
    env: dict[fx.Node, Any] = {node: graph.call_function(operator.getitem, (x, i)) if unpack else x for i, node in enumerate(inputs)}
    for node in cutter.nodes:
        if node in emit and node is not output_node:
            env[node] = graph.node_copy(node, env.__getitem__)
    if outputs is None:
        graph.output(fx.map_arg(output_node.args[0], env.__getitem__))
    else:
        graph.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[node] for node in outputs))
    return fx.GraphModule(cutter.program.graph_module, graph, class_name="TracedLayer")


def cut_program(program: TracedProgram) -> TracedLayers:
    """The traced program as a layer list (module docstring)."""
    cutter = _Cutter(program)
    plan = cutter.assign()
    bounds = [cut for cut in range(plan.count - 1) if cutter.keeps(plan, cut)]
    groups = list(zip([0, *(cut + 1 for cut in bounds)], [*bounds, plan.count - 1]))
    placeholders = [node for node in cutter.nodes if node.op == "placeholder"]
    layers, calls = [], []
    for number, (first, last) in enumerate(groups):
        inputs = placeholders if first == 0 else cutter.crossing(plan, first - 1)
        outputs = None if number == len(groups) - 1 else cutter.crossing(plan, last)
        layers.append(_build(cutter, plan, first, last, inputs, outputs))
        calls.append([str(anchor.target) for anchor in cutter.anchors[first : last + 1]])
    return TracedLayers(layers, calls, program.name, [str(node.target) for node in placeholders])


def traced_layers(module: nn.Module, samples: Sequence[tuple]) -> TracedLayers:
    """Trace ``module.forward`` on ``samples`` (positional arguments of ``self(...)`` at two
    batch sizes) and cut it into layers. A ``forward`` that calls one Hugging Face model
    with its own arguments gets that model's blocks as layers (``profile/hf_layers.py``)."""
    found = hf_layers(module, samples, TracedLayers)
    if found is not None:
        return found  # type: ignore[return-value]
    return cut_program(trace_forward(module, samples))
