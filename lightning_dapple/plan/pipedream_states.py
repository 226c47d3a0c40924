"""PipeDream's states of a branching model: the antichain DAG of its operator graph.

PipeDream's optimizer (PipeDream 3.1; its public optimizer) does not cut a linear order
of layers. It cuts the operator graph between *antichains*: a state is a set of nodes no
two of which depend on each other, "augmented" with the earlier nodes whose outputs are
still needed after it; a stage is what lies between two states, one an ancestor of the
other in the DAG of states. A chain of n nodes has n states (its prefixes); a branching
graph has more (ResNet-50's 177 profiled nodes give 240 states once the input is set
aside), so a split may fall inside a residual block.

For each state this module derives what the dynamic programme needs: the compute time,
parameter bytes and activation bytes of everything up to and including it, the activation
bytes crossing it, and which states are its ancestors. Profiles without a graph (our own
profiler's chains) get the chain's states.

Following PipeDream, model inputs (source nodes described ``Input...``) are set aside
(they always belong to the first stage), and unused ``__getitem__`` sinks are dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from lightning_dapple.profile.model_profile import ModelProfile

__all__ = ["PipeDreamStates", "pipedream_states"]


@dataclass(frozen=True)
class PipeDreamStates:
    """The antichain DAG's states in topological order, with cumulative quantities.

    ``compute_ms[i]``, ``param_bytes[i]``, ``activation_bytes[i]``: sums over every node up
    to state i (the state's nodes included); ``output_bytes[i]``: activations of the state's
    (augmented) nodes, what crosses a cut after it; ``ancestors[j, k]``: state k precedes j;
    ``closure[i]``: the profile layer positions up to state i (as a bit set).
    """

    compute_ms: np.ndarray
    param_bytes: np.ndarray
    activation_bytes: np.ndarray
    output_bytes: np.ndarray
    ancestors: np.ndarray
    closure: tuple[int, ...]
    removed: int  # bit set of the layer positions set aside (model inputs)

    @property
    def count(self) -> int:
        return len(self.compute_ms)

    def cut_position(self, state: int) -> int:
        """Where a cut after ``state`` falls in the profile's linear layer order: after
        as many layers as lie up to the state (inputs included); exact when those layers
        are a prefix of the order."""
        return bin(self.closure[state] | self.removed).count("1")


class _Graph:
    """Node-level DAG over profile positions, with ancestor bit sets."""

    def __init__(self, count: int, edges: Sequence[tuple[int, int]], keep: set[int]) -> None:
        self.nodes = [v for v in range(count) if v in keep]
        self.succ: dict[int, list[int]] = {v: [] for v in self.nodes}
        self.pred: dict[int, list[int]] = {v: [] for v in self.nodes}
        for a, b in edges:
            if a in keep and b in keep:
                self.succ[a].append(b)
                self.pred[b].append(a)
        self.anc: dict[int, int] = {}
        for v in self.nodes:  # positions are a topological order
            bits = 0
            for p in self.pred[v]:
                bits |= self.anc[p] | (1 << p)
            self.anc[v] = bits
        self.desc: dict[int, int] = {}
        for v in reversed(self.nodes):
            bits = 0
            for s in self.succ[v]:
                bits |= self.desc[s] | (1 << s)
            self.desc[v] = bits

    def augment(self, antichain: tuple[int, ...]) -> tuple[int, ...]:
        """The antichain plus earlier nodes with an edge leaving what precedes some member."""
        extra = []
        for a in antichain:
            inside = self.anc[a] | (1 << a)
            for p in _members(self.anc[a]):
                if p not in extra and any(not (inside >> s) & 1 for s in self.succ[p]):
                    extra.append(p)
        return tuple(sorted(set(extra) | set(antichain)))

    def deaugment(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """Drop members that precede another member."""
        bits = 0
        for v in nodes:
            bits |= 1 << v
        return tuple(sorted({v for v in nodes if not (self.desc[v] & bits)}))

    def next_antichains(self, antichain: tuple[int, ...]) -> list[tuple[int, ...]]:
        augmented = self.augment(antichain)
        bits = 0
        for v in augmented:
            bits |= 1 << v
        out = []
        for u in augmented:
            for v in self.succ[u]:
                if v in antichain or self.desc[v] & bits:
                    continue
                out.append(self.deaugment([v if x == u else x for x in augmented]))
        return out


def _members(bits: int) -> list[int]:
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return out


def _graph_of(profile: ModelProfile, chain: bool) -> tuple[_Graph, int]:
    """The profile's node graph (its linear order as a chain if ``chain``) without model
    inputs and unused ``__getitem__`` sinks."""
    n = profile.num_layers
    edges = [] if chain else [tuple(edge) for edge in profile.meta.get("edges", [])]
    edges = edges or [(v, v + 1) for v in range(n - 1)]
    has_pred = {b for _, b in edges}
    has_succ = {a for a, _ in edges}
    labels = [layer.name.split(": ", 1)[-1] for layer in profile.layers]
    removed = {v for v in range(n) if v not in has_pred and labels[v].startswith("Input")}
    dropped = {v for v in range(n) if v not in has_succ and labels[v].startswith("__getitem__")}
    bits = 0
    for v in removed:
        bits |= 1 << v
    keep = set(range(n)) - removed - dropped
    return _Graph(n, edges, keep), bits


def pipedream_states(profile: ModelProfile, chain: bool = False) -> PipeDreamStates:
    """Enumerate the antichain states (breadth first from the first source, as PipeDream
    does) and order them topologically; ``chain`` uses the profile's linear order instead
    of its graph (one state per layer)."""
    graph, removed = _graph_of(profile, chain)
    sources = [v for v in graph.nodes if not graph.pred[v]]
    start = (sources[0],)
    index = {start: 0}
    order = [start]
    edges: list[tuple[int, int]] = []
    queue = deque([start])
    expanded: set[tuple[int, ...]] = set()
    while queue:
        antichain = queue.popleft()
        if antichain in expanded:
            continue
        expanded.add(antichain)
        for nxt in graph.next_antichains(antichain):
            if nxt not in index:
                index[nxt] = len(order)
                order.append(nxt)
            edges.append((index[antichain], index[nxt]))
            queue.append(nxt)
    topo = _topological(len(order), edges)
    return _summarise(profile, graph, removed, [order[i] for i in topo], _relabel(edges, topo))


def _topological(count: int, edges: list[tuple[int, int]]) -> list[int]:
    succ: list[list[int]] = [[] for _ in range(count)]
    indegree = [0] * count
    for a, b in set(edges):
        succ[a].append(b)
        indegree[b] += 1
    ready = deque(sorted(v for v in range(count) if indegree[v] == 0))
    out = []
    while ready:
        v = ready.popleft()
        out.append(v)
        for w in sorted(succ[v]):
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    return out


def _relabel(edges: list[tuple[int, int]], topo: list[int]) -> list[tuple[int, int]]:
    new = {old: i for i, old in enumerate(topo)}
    return sorted({(new[a], new[b]) for a, b in edges})


def _summarise(profile: ModelProfile, graph: _Graph, removed: int, states: list[tuple[int, ...]], edges: list[tuple[int, int]]) -> PipeDreamStates:
    layers = profile.layers
    activation = profile.meta.get("activation_bytes") or [layer.stash_for(1.0) for layer in layers]
    count = len(states)
    compute = np.zeros(count)
    params = np.zeros(count)
    acts = np.zeros(count)
    output = np.zeros(count)
    closure = []
    for i, antichain in enumerate(states):
        augmented = graph.augment(antichain)
        bits = 0
        for v in augmented:
            bits |= graph.anc[v] | (1 << v)
        members = _members(bits)
        closure.append(bits)
        compute[i] = sum(layers[v].forward_ms + layers[v].backward_ms for v in members)
        params[i] = sum(layers[v].param_bytes for v in members)
        acts[i] = sum(activation[v] for v in members)
        output[i] = sum(activation[v] for v in augmented)
    ancestors = np.zeros((count, count), dtype=bool)
    for a, b in edges:  # edges go forward in topological order
        ancestors[b, a] = True
    for j in range(count):
        for k in np.nonzero(ancestors[j])[0]:
            ancestors[j] |= ancestors[k]
    return PipeDreamStates(compute, params, acts, output, ancestors, tuple(closure), removed)
