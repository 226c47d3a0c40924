"""Recomputation (gpipe.txt 2.3 re-materialization) and the B/W split, built on autograd.

Why not ``torch.utils.checkpoint``: its non-reentrant form recomputes once per autograd
*graph task* and keeps what it recomputed for a task until the saved-tensor holders die.
Out-of-order backprop runs one task for B and more for W, so a checkpointed region would
be recomputed for each of them and the B task's recomputed activations would stay alive
until W -- the known failure where weight-gradient deferral plus checkpointing keeps every
activation. Here the stage forward is replayed *once*, explicitly, right before B; B and
the deferred W then use that one graph, and each W frees the part of it it consumed.

Pieces used by ``execute/runner.py``:

* ``discard_saved()``: a forward that records the graph (so each output knows whether it
  requires grad) but keeps none of the tensors saved for backward; used for the F of a
  recomputed micro-batch, which keeps only the stage input;
* ``seeded(seed, device)``: run under a fixed RNG seed and restore the caller's RNG state
  afterwards, so the F of a micro-batch and its recomputation draw the same dropout masks
  and the rest of the program sees an RNG stream the pipeline did not advance (a training
  step saves and restores once, with ``save_rng``/``restore_rng``, and ``reseed``s per forward);
* ``frozen_buffers(modules)``: buffers (BatchNorm running statistics) are put back after
  a recomputation, so they are updated once per micro-batch as without it;
* ``weight_groups(layers)``: the unit of W work -- one layer, or several layers merged
  when they share a parameter (a layer's W then covers all uses of it);
* ``output_edges`` / ``tensor_bytes``: autograd edges of a layer's outputs (so W can use
  them without keeping the output tensors alive) and the byte rule of the stash meter;
* ``weight_work``: where a layer's W starts (below).

Where W starts. The simplest split keeps the gradient of each layer's *output* and lets W
backpropagate from there to the layer's parameters -- but that re-runs every operation
between the output and the weights (an activation, a normalisation, for a transformer
block nearly the whole block). Instead, after the layer's forward, its autograd graph is
walked once: a node *reaches the input* when a path leads from it to the layer's input,
and *reaches weights* when a path leads to one of the layer's parameters. B runs every
node that reaches the input; W needs only the nodes that reach weights but not the input,
entered from their parents. So B captures the gradient arriving at each such parent (the
*frontier*: e.g. at the output of each GEMM that uses a weight) and W runs, per frontier
node, just that node's weight part and what lies below it. Nothing of B is done twice. The
frontier is used when it is exact -- no parameter of a frontier node is also reachable
through its input-side children -- and when its gradients are no bigger than the layer's
output gradients or its stash (the bound the planner's memory model charges a deferred
W); otherwise W starts from the layer's outputs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils import _pytree as pytree

__all__ = [
    "WeightWork",
    "weight_work",
    "discard_saved",
    "frozen_buffers",
    "output_edges",
    "seeded",
    "save_rng",
    "restore_rng",
    "reseed",
    "tensor_bytes",
    "tensor_leaves",
    "weight_groups",
]


def _drop(tensor: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:  # pragma: no cover - the graph is never run
    raise RuntimeError("this graph was recorded without saved tensors; recompute the forward before its backward")


def discard_saved() -> contextlib.AbstractContextManager[Any]:
    """Record autograd graphs without keeping any tensor saved for backward."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with the CPU (and ``device``'s CUDA) generator seeded by ``seed``; restore after."""
    state = save_rng(device)
    try:
        reseed(seed, device)
        yield
    finally:
        restore_rng(state)


def save_rng(device: torch.device) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
    """The CPU (and ``device``'s CUDA) generator state, for ``restore_rng``. A training step
    saves it once and ``reseed``s before each forward, rather than saving and restoring around
    every micro-batch (two tensor copies per forward on the per-micro-batch path)."""
    cuda_state = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda_state = (index, torch.cuda.get_rng_state(index))
    return torch.get_rng_state(), cuda_state


def restore_rng(state: tuple[torch.Tensor, tuple[int, torch.Tensor] | None]) -> None:
    cpu_state, cuda_state = state
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state[1], cuda_state[0])


def reseed(seed: int, device: torch.device) -> None:
    """Seed the CPU (and ``device``'s CUDA) generator (between ``save_rng`` and ``restore_rng``)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)
    torch.default_generator.manual_seed(seed)


@contextlib.contextmanager
def frozen_buffers(buffers: Sequence[torch.Tensor]) -> Iterator[None]:
    """Restore ``buffers`` to their values on entry when leaving."""
    saved = [buffer.detach().clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)


def weight_groups(layers: Sequence[nn.Module]) -> list[tuple[int, int]]:
    """Half-open stage-local layer ranges of W work: each layer with trainable parameters
    on its own, merged (with everything between) when layers share a parameter."""
    owners: dict[int, list[int]] = {}
    for index, layer in enumerate(layers):
        for param in layer.parameters():
            if param.requires_grad:
                owners.setdefault(id(param), []).append(index)
    groups = [[index, index + 1] for index in sorted({i for uses in owners.values() for i in uses})]
    for uses in owners.values():
        lo, hi = min(uses), max(uses) + 1
        if hi - lo > 1:
            merged = [g for g in groups if g[1] <= lo or g[0] >= hi]
            span = [g for g in groups if not (g[1] <= lo or g[0] >= hi)]
            merged.append([min(lo, *(g[0] for g in span)), max(hi, *(g[1] for g in span))])
            groups = sorted(merged)
    return [(a, b) for a, b in groups]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if type(value) is torch.Tensor:  # the common layer output: no tree walk
        return [value]
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def output_edges(value: Any) -> list[GradientEdge]:
    """Autograd edges of the leaves of ``value`` that require grad (deduplicated)."""
    edges, seen = [], set()
    for leaf in tensor_leaves(value):
        if not leaf.requires_grad:
            continue
        edge = get_gradient_edge(leaf)
        key = (id(edge.node), edge.output_nr)
        if key not in seen:
            seen.add(key)
            edges.append(edge)
    return edges


def tensor_bytes(value: Any) -> int:
    """Bytes of the distinct tensors in ``value`` (a slice counts as its own rows)."""
    total, seen = 0, set()
    for leaf in tensor_leaves(value):
        key = (leaf.data_ptr(), tuple(leaf.shape), leaf.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += leaf.numel() * leaf.element_size()
    return total


@dataclass
class WeightWork:
    """One piece of W: backpropagate the gradients of ``edges`` to ``params``."""

    edges: list[GradientEdge]
    params: list[nn.Parameter]
    nbytes: int = 0


def _edge_bytes(node: Any, slot: int) -> int:
    meta = node._input_metadata[slot]
    count = 1
    for dim in meta.shape:
        count *= int(dim)
    return count * meta.dtype.itemsize


def weight_work(
    outputs: Sequence[GradientEdge],
    inputs: Sequence[GradientEdge],
    params: Sequence[nn.Parameter],
    limit_bytes: int,
) -> list[WeightWork]:
    """The W pieces of one layer (group): the frontier described in the module docstring,
    or one piece from the layer's ``outputs`` when the frontier is not exact or its
    gradients would exceed ``limit_bytes``."""
    fallback = [WeightWork(list(outputs), list(params))]
    if not outputs or not params:
        return fallback
    wanted = {id(p) for p in params}
    stop = {id(edge.node) for edge in inputs}
    seen: dict[int, tuple[bool, frozenset[int]]] = {}
    nodes: dict[int, Any] = {}

    def visit(node: Any) -> tuple[bool, frozenset[int]]:
        key = id(node)
        if key in seen:
            return seen[key]
        nodes[key] = node
        if key in stop:
            result = (True, frozenset())
        elif hasattr(node, "variable"):  # AccumulateGrad of a leaf
            result = (False, frozenset({id(node.variable)}) & wanted)
        else:
            reaches_input = False
            reached: set[int] = set()
            for child, _ in node.next_functions:
                if child is None:
                    continue
                child_input, child_params = visit(child)
                reaches_input = reaches_input or child_input
                reached.update(child_params)
            result = (reaches_input, frozenset(reached))
        seen[key] = result
        return result

    try:
        for edge in outputs:
            visit(edge.node)
        return _frontier(outputs, params, seen, nodes, stop, limit_bytes) or fallback
    except (RecursionError, AttributeError, IndexError):  # very deep graphs, nodes without metadata
        return fallback


def _frontier(
    outputs: Sequence[GradientEdge],
    params: Sequence[nn.Parameter],
    seen: dict[int, tuple[bool, frozenset[int]]],
    nodes: dict[int, Any],
    stop: set[int],
    limit_bytes: int,
) -> list[WeightWork] | None:
    pieces: list[WeightWork] = []
    covered: set[int] = set()
    for edge in outputs:  # an output computed from weights alone: W starts right there
        reaches_input, reached = seen[id(edge.node)]
        if not reaches_input and reached:
            pieces.append(WeightWork([edge], [p for p in params if id(p) in reached], _edge_bytes(edge.node, edge.output_nr)))
            covered.add(id(edge.node))
    for key, node in nodes.items():
        reaches_input, _ = seen[key]
        if not reaches_input or key in stop or hasattr(node, "variable"):
            continue
        own: set[int] = set()
        other: set[int] = set()
        for child, _ in node.next_functions:
            if child is None:
                continue
            child_input, child_params = seen[id(child)]
            (other if child_input else own).update(child_params)
        if not own:
            continue
        if own & other:
            return None  # the same weight also lies below the input side: not exact
        slots = range(len(node._input_metadata))
        pieces.append(
            WeightWork(
                [GradientEdge(node, slot) for slot in slots],
                [p for p in params if id(p) in own],
                sum(_edge_bytes(node, slot) for slot in slots),
            )
        )
    found = set()
    for piece in pieces:
        found.update(id(p) for p in piece.params)
    if not pieces or found != {id(p) for p in params if id(p) in _reached(seen, outputs)}:
        return None
    if sum(piece.nbytes for piece in pieces) > limit_bytes:
        return None
    return pieces


def _reached(seen: dict[int, tuple[bool, frozenset[int]]], outputs: Sequence[GradientEdge]) -> set[int]:
    out: set[int] = set()
    for edge in outputs:
        out.update(seen[id(edge.node)][1])
    return out
