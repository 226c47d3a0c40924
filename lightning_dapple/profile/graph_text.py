"""Read PipeDream's graph text profiles (the files under shared/profiles/) as a ModelProfile.

PipeDream's profiler (PipeDream 3.2, "Profiling the DNN Model") writes one line per operator node with its forward
and backward compute time, output activation size and parameter size, followed by one
tab-indented line per data-flow edge. The DAPPLE authors published their benchmark
profiles in the same format. These are exactly the quantities DAPPLE's planner needs
(DAPPLE 2 and 4.1: per-layer forward/backward time, parameter bytes for the AllReduce term,
activation bytes for cross-stage transfers), so the planner can read them directly.

DAPPLE partitions a model as a chain of layers, while the graphs may branch (GNMT,
Inception, NASNet, AmoebaNet, DenseNet). We linearise the DAG in a deterministic
topological order and charge each cut with every activation that crosses it: a node's
output must be sent to the next stage whenever the node is placed at or before the cut and
at least one of its consumers after it (DAPPLE 4.3's planner places stage boundaries on such a
linear order).

What the format does not say, and what we therefore estimate (recorded in ``meta``):

* ``stash_bytes`` (what a layer keeps from forward to backward, DAPPLE 5.3) is taken to be
  the node's own activation size, except for nodes that allocate nothing: an in-place
  operator (``ReLU(inplace)``, ``Add(inplace)``) writes into its input's memory, and a
  node that takes no time either way after another node (``View``, ``Size``) is a view of
  it, so both stash 0 (``_stash_bytes``);
* the model ``input_bytes`` is the activation size of the source nodes (no incoming edge);
* a source node whose description starts with ``Input`` is the data input, not an
  operator: PipeDream's profiler records the host-to-device copy (and data loading) there
  (XLNet-36: 17 ms per sample; ResNet-18: 474 ms per batch of 64). Both planners that
  published these profiles zero it before planning (PipeDream's optimizer
  ``optimizer_graph_hierarchical.py``, the DAPPLE planner's graph importer), since an
  input pipeline overlaps training and the input is on the first stage whatever the
  plan; so do we (``_is_data_input``), keeping the node with no time and no parameters
  and recording the dropped times in ``meta["data_input_ms"]``;
* a node listing several outputs (``activation_size=[a; b; c]``) is charged their sum,
  whichever consumer actually reads which output.
"""
from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile

__all__ = ["parse_graph_text"]

_SEP = " -- "
_NAME_CHARS = 60
_REQUIRED_KEYS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_PBS = re.compile(r"pbs-(\d+)")
_FORMAT_HINT = (
    "write node lines as 'nodeN -- DESCRIPTION -- forward_compute_time=F, backward_compute_time=B, "
    "activation_size=A, parameter_size=P' and edge lines as '<tab>nodeA -- nodeB' "
    "(see shared/profiles/README.md)"
)


@dataclass
class _Node:
    node_id: str
    description: str
    forward_ms: float
    backward_ms: float
    activation_bytes: float
    param_bytes: float
    line: int


def _where(name: str, line: int) -> str:
    return f"{name} line {line}"


def _parse_number(text: str, key: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DappleConfigError(where, f"{key}={text!r} is not a number", "write a plain decimal number") from None
    require(math.isfinite(value), where, f"{key}={text!r} is not finite", "write a finite number")
    require(value >= 0, where, f"{key} is negative ({value})", "times and sizes must be >= 0")
    return value


def _parse_size(text: str, key: str, where: str) -> float:
    """A size, or a bracketed ``[a; b; c]`` list of sizes (summed)."""
    text = text.strip()
    if text.startswith("["):
        require(text.endswith("]"), where, f"{key}={text!r} has an unclosed '['", "write lists as [a; b; c]")
        items = [item.strip() for item in text[1:-1].split(";") if item.strip()]
        return sum(_parse_number(item, key, where) for item in items)
    return _parse_number(text, key, where)


def _parse_metrics(text: str, where: str) -> dict[str, float]:
    values: dict[str, str] = {}
    # Lists use ';' inside brackets, so ',' only separates the key=value pairs.
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        require("=" in part, where, f"expected key=value, got {part!r}", _FORMAT_HINT)
        key, value = (piece.strip() for piece in part.split("=", 1))
        require(key not in values, where, f"{key} is given twice", "give each key once")
        values[key] = value
    missing = [key for key in _REQUIRED_KEYS if key not in values]
    require(not missing, where, f"node is missing {', '.join(missing)}", _FORMAT_HINT)
    return {
        "forward_compute_time": _parse_number(values["forward_compute_time"], "forward_compute_time", where),
        "backward_compute_time": _parse_number(values["backward_compute_time"], "backward_compute_time", where),
        "activation_size": _parse_size(values["activation_size"], "activation_size", where),
        "parameter_size": _parse_size(values["parameter_size"], "parameter_size", where),
    }


def _check_id(node_id: str, where: str) -> str:
    require(
        bool(node_id) and not any(ch.isspace() for ch in node_id),
        where,
        f"node id {node_id!r} is empty or contains whitespace",
        _FORMAT_HINT,
    )
    return node_id


def _batch_size(name: str, profile_batch_size: int | None) -> int:
    if profile_batch_size is not None:
        require(
            isinstance(profile_batch_size, int) and not isinstance(profile_batch_size, bool) and profile_batch_size > 0,
            "profile_batch_size",
            f"must be a positive integer, got {profile_batch_size!r}",
            "pass the batch size the graph was profiled at, e.g. --profile-batch-size 64",
        )
        return profile_batch_size
    match = _PBS.search(name)
    if match is None or int(match.group(1)) <= 0:
        raise DappleConfigError(
            f"profile {name}",
            "the profile batch size is unknown (no 'pbs-N' in the file name)",
            "pass --profile-batch-size N (the micro-batch size the times were measured at; "
            "the PipeDream graphs in shared/profiles/pipedream/ are batch 64)",
        )
    return int(match.group(1))


def _readable(description: str) -> str:
    text = " ".join(description.split())
    return text if len(text) <= _NAME_CHARS else text[: _NAME_CHARS - 3] + "..."


def _find_cycle_edge(remaining: set[str], preds: dict[str, list[str]], edge_line: dict[tuple[str, str], int]) -> tuple[str, str, int]:
    """An edge on a cycle among ``remaining`` (every one of them has a remaining predecessor)."""
    start = min(remaining)
    seen: dict[str, int] = {}
    path: list[str] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(p for p in preds[node] if p in remaining)
    cycle = path[seen[node]:]
    # path goes from a node to its predecessor, so edges are (cycle[i+1] -> cycle[i]).
    edges = [(cycle[(i + 1) % len(cycle)], cycle[i]) for i in range(len(cycle))]
    src, dst = min(edges, key=lambda edge: edge_line[edge])
    return src, dst, edge_line[(src, dst)]


_INPLACE = re.compile(r"\binplace\b(?!\s*=\s*False)", re.IGNORECASE)


def _is_data_input(node: _Node, has_input: bool) -> bool:
    """A source node named ``Input...``: the data input (see the module docstring)."""
    return not has_input and node.description.startswith("Input")


def _stash_bytes(node: _Node, has_input: bool) -> float:
    """Bytes a node adds to the stash: its activation, unless it allocates none (an
    in-place operator, or a zero-time view of its input)."""
    if _INPLACE.search(node.description):
        return 0.0
    if has_input and node.forward_ms == 0.0 and node.backward_ms == 0.0:
        return 0.0
    return node.activation_bytes


def _read_lines(text: str, name: str) -> tuple[dict[str, _Node], list[str], list[tuple[str, str, int]]]:
    """Node lines (in file order) and edge lines (source, destination, line number)."""
    nodes: dict[str, _Node] = {}
    order: list[str] = []
    edges: list[tuple[str, str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = _where(name, number)
        first = line.find(_SEP)
        require(first >= 0, where, f"expected ' -- ' in {line[:80]!r}", _FORMAT_HINT)
        last = line.rfind(_SEP)
        head, tail = line[:first].strip(), line[last + len(_SEP):].strip()
        if first == last and "=" not in tail:
            edges.append((_check_id(head, where), _check_id(tail, where), number))
            continue
        require(first != last, where, f"node line has no description part: {line[:80]!r}", _FORMAT_HINT)
        node_id = _check_id(head, where)
        if node_id in nodes:
            raise DappleConfigError(
                where, f"node {node_id} is defined again (first at line {nodes[node_id].line})", "give every node a unique id"
            )
        metrics = _parse_metrics(tail, where)
        nodes[node_id] = _Node(
            node_id=node_id,
            description=line[first + len(_SEP):last].strip(),
            forward_ms=metrics["forward_compute_time"],
            backward_ms=metrics["backward_compute_time"],
            activation_bytes=metrics["activation_size"],
            param_bytes=metrics["parameter_size"],
            line=number,
        )
        order.append(node_id)
    require(bool(nodes), f"profile {name}", "contains no node lines", _FORMAT_HINT)
    return nodes, order, edges


def _link(
    nodes: dict[str, _Node], order: list[str], edges: list[tuple[str, str, int]], name: str
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[tuple[str, str], int]]:
    """Successor and predecessor lists and each edge's line; unknown ends and self-loops are errors."""
    succs: dict[str, list[str]] = {node_id: [] for node_id in order}
    preds: dict[str, list[str]] = {node_id: [] for node_id in order}
    edge_line: dict[tuple[str, str], int] = {}
    for src, dst, number in edges:
        for end in (src, dst):
            if end not in nodes:
                raise DappleConfigError(
                    _where(name, number), f"edge {src} -- {dst} names unknown node {end}", "define every node before using it in an edge, or fix the id"
                )
        if src == dst:
            raise DappleConfigError(_where(name, number), f"edge {src} -- {dst} is a self-loop (a cycle)", "remove the edge; the graph must be acyclic")
        if (src, dst) in edge_line:
            continue  # a repeated edge adds nothing
        edge_line[(src, dst)] = number
        succs[src].append(dst)
        preds[dst].append(src)
    return succs, preds, edge_line


def _linearise(
    order: list[str], succs: dict[str, list[str]], preds: dict[str, list[str]], edge_line: dict[tuple[str, str], int], name: str
) -> list[str]:
    """Kahn's algorithm; the ready set is ordered by file position so the result is deterministic."""
    file_index = {node_id: index for index, node_id in enumerate(order)}
    indegree = {node_id: len(preds[node_id]) for node_id in order}
    ready = [file_index[n] for n in order if indegree[n] == 0]
    heapq.heapify(ready)
    linear: list[str] = []
    while ready:
        node_id = order[heapq.heappop(ready)]
        linear.append(node_id)
        for succ in succs[node_id]:
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, file_index[succ])
    if len(linear) < len(order):
        done = set(linear)
        remaining = {n for n in order if n not in done}
        src, dst, number = _find_cycle_edge(remaining, preds, edge_line)
        raise DappleConfigError(
            _where(name, number), f"edge {src} -- {dst} closes a cycle", "remove an edge of the cycle; the graph must be acyclic"
        )
    return linear


def _crossing_bytes(linear: list[str], nodes: dict[str, _Node], succs: dict[str, list[str]], position: dict[str, int]) -> list[float]:
    """Activation bytes crossing the cut after each position (the last: the model output)."""
    count = len(linear)
    # Difference array: node v crosses every cut in [pos(v), last consumer pos - 1].
    delta = [0.0] * (count + 1)
    for node_id in linear:
        if succs[node_id]:
            last_consumer = max(position[s] for s in succs[node_id])
            delta[position[node_id]] += nodes[node_id].activation_bytes
            delta[last_consumer] -= nodes[node_id].activation_bytes
    crossing: list[float] = []
    running = 0.0
    for index in range(count):
        running += delta[index]
        crossing.append(max(running, 0.0))
    crossing[-1] = nodes[linear[-1]].activation_bytes
    return crossing


def parse_graph_text(text: str, name: str = "graph", profile_batch_size: int | None = None) -> ModelProfile:
    """Parse PipeDream graph text into a chain-of-layers profile (PipeDream 3.2, DAPPLE 2 and 4.1).

    Node lines are ``ID -- DESCRIPTION -- key=value, ...`` (split on the first and the last
    `` -- `` so descriptions may contain the separator); edge lines are ``A -- B`` and are
    recognised by having no ``key=value`` part. Leading and trailing whitespace is ignored
    on every line, which is what makes ``amoeba-36-pbs-1.txt`` (edges indented with a space
    before the tab, which PipeDream's own parser rejects) load.

    The DAG is linearised with Kahn's algorithm, ties broken by the order nodes appear in
    the file. Position ``p``'s ``output_bytes`` is the sum of activation sizes of nodes at
    or before ``p`` with a consumer after ``p``; for the last position (after which nothing
    crosses) it is the last node's own activation, the model output.

    ``micro_batch_size`` is ``profile_batch_size`` or else ``pbs-N`` in ``name``.
    Raises ``DappleConfigError`` naming the line for malformed lines, negative or
    non-numeric values, duplicate nodes, edges to unknown nodes and cycles.
    """
    micro_batch_size = _batch_size(name, profile_batch_size)
    nodes, order, edges = _read_lines(text, name)
    succs, preds, edge_line = _link(nodes, order, edges, name)
    linear = _linearise(order, succs, preds, edge_line, name)
    position = {node_id: index for index, node_id in enumerate(linear)}
    crossing = _crossing_bytes(linear, nodes, succs, position)
    readable = {node_id: _readable(nodes[node_id].description) or node_id for node_id in linear}
    seen: dict[str, int] = {}
    for label in readable.values():
        seen[label] = seen.get(label, 0) + 1
    layers = []
    data_input_ms = {}
    for index, node_id in enumerate(linear):
        node = nodes[node_id]
        label = readable[node_id]
        if seen[label] > 1 and label != node_id:
            label = f"{node_id}: {label}"
        data_input = _is_data_input(node, bool(preds[node_id]))
        if data_input and (node.forward_ms or node.backward_ms):
            data_input_ms[label] = [node.forward_ms, node.backward_ms]
        layers.append(
            LayerProfile(
                name=label,
                forward_ms=0.0 if data_input else node.forward_ms,
                backward_ms=0.0 if data_input else node.backward_ms,
                output_bytes=crossing[index],
                param_bytes=0.0 if data_input else node.param_bytes,
                stash_bytes=_stash_bytes(node, bool(preds[node_id])),
            )
        )

    input_bytes = sum(nodes[n].activation_bytes for n in linear if not preds[n])
    return ModelProfile(
        micro_batch_size=micro_batch_size,
        layers=tuple(layers),
        name=name,
        input_bytes=input_bytes,
        meta={
            "source": "pipedream-graph-text",
            "nodes": linear,
            "branching": any(len(succs[n]) > 1 or len(preds[n]) > 1 for n in linear),
            "edges": [[position[src], position[dst]] for src, dst in edge_line],
            "activation_bytes": [nodes[n].activation_bytes for n in linear],
            "stash_bytes": "estimated from each node's activation_size (0 for in-place operators and views)",
            "input_bytes": "estimated from the activation_size of source nodes",
            "data_input_ms": data_input_ms,
        },
    )
