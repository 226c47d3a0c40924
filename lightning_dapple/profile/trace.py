"""Trace a module's ``forward`` once into a program of child-module calls and glue (the
model graph DAPPLE 5.2.1 builds its stages from).

A model without a layer sequence still has one in its ``forward``: an embedding, a loop
over blocks, a final norm and a head, with a little glue between them (a position
embedding added, ``torch.flatten`` between pooling and classifier). DAPPLE's stages are
runs of consecutive layers (DAPPLE 4), so what is needed is that sequence of calls and
the glue between them, as a program that can be cut (``profile/traced_layers.py``).

Why ``torch.fx`` and not ``torch.export``: fx's symbolic tracer takes a leaf predicate.
Here every child module is a leaf: its call is recorded as one node and its own
``forward`` never runs under the tracer, so a block's data-dependent control flow
(``nn.Transformer``'s causal-mask check, a block that branches on its input) is never
traced, and the recorded program calls the module's own objects with the same operations
as ``forward``, so it computes the same values and gradients. ``torch.export`` traces
through every submodule down to ATen operators, so such control flow anywhere in the
model stops it (``torch.distributed.pipelining.pipeline()`` uses it and fails on
Lightning's demo Transformer and on Hugging Face GPT-2), and its functionalised graph
need not give bit-identical gradients.

Two kinds of child are expanded instead of kept whole: a plain ``nn.Sequential`` (its
forward is the sequence itself) and a wrapper of the user's own that is the only module
its parent's forward calls (``forward(x): return self.model(x)``), whose own forward is
then traced.
``assert`` statements on traced values become ``torch._assert`` calls. Any other use of a
traced value in Python control flow, or any other failure, is one ``DappleConfigError``
naming what failed, where (file:line) and the manual fix.
"""
from __future__ import annotations

import dis
import inspect
import operator
import os
import traceback
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.fx._symbolic_trace import _assert_is_none
from torch import nn

from lightning_dapple.errors import DappleConfigError

__all__ = ["LAYER_LIST_FIX", "TracedProgram", "ValueKind", "forward_signature", "trace_forward"]

LAYER_LIST_FIX = (
    "give the layer list by hand: keep the layers in an nn.Sequential that forward applies in order "
    "(self.layers = nn.Sequential(...); forward(x): return self.layers(x)) and pass DappleStrategy(layers='layers') "
    "(docs/models.md: 'Layer lists found from forward')"
)
_TORCH_DIR = os.path.dirname(torch.__file__)
# factories whose sizes come as plain arguments, which fx's proxies cannot stand in for
_SIZED_FACTORIES = ("ones", "zeros", "empty", "full", "rand", "randn", "randint", "eye", "linspace", "tensor")
_THIS_FILE = os.path.abspath(__file__)


class _TraceStop(Exception):
    """Tracing met something the traced program cannot express, at ``where``."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(what)
        self.what = what
        self.where = where


@dataclass(frozen=True)
class ValueKind:
    """What a traced value was on the sample inputs: a tensor whose first dimension is the
    batch's (``per_sample``), another tensor or container, or a plain Python value
    (``scalar``: a size, a dtype, a device, a number) that can be recomputed anywhere."""

    per_sample: bool
    scalar: bool


@dataclass(frozen=True)
class TracedProgram:
    """The traced ``forward``: a GraphModule over the module's own children and tensors,
    the number of positional inputs it takes, and the kind of every value on the samples."""

    graph_module: fx.GraphModule
    num_inputs: int
    kinds: dict[str, ValueKind]
    name: str


def _is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost caller outside torch and this file: the line of the model's code."""
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or os.path.abspath(frame.f_code.co_filename) == _THIS_FILE):
        frame = frame.f_back
    return frame


def _place(filename: str, line: int | None) -> str:
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        relative = filename
    shown = relative if not relative.startswith("..") else filename
    return f"{shown}:{line}"


def _forward_place(module: nn.Module) -> str:
    """Where the module's ``forward`` is defined (for failures of forward as a whole)."""
    forward = inspect.unwrap(type(module).forward)
    try:
        return _place(inspect.getsourcefile(forward) or "forward", inspect.getsourcelines(forward)[1])
    except (OSError, TypeError):
        return f"{type(module).__name__}.forward"


def _is_assert(frame: FrameType) -> bool:
    """Whether the instruction now converting a value to bool is an ``assert``'s test."""
    instructions = [inst for inst in dis.get_instructions(frame.f_code) if inst.opname != "CACHE"]
    at = bisect_left(instructions, frame.f_lasti, key=lambda inst: inst.offset)
    # the conversion happens at the jump (3.11, 3.12) or just before it (TO_BOOL, 3.13)
    for jump, following in zip(instructions[at : at + 2], instructions[at + 1 : at + 3]):
        if jump.opname.startswith("POP_JUMP") and "IF_TRUE" in jump.opname:
            return following.opname == "LOAD_ASSERTION_ERROR" or (following.opname == "LOAD_GLOBAL" and following.argval == "AssertionError")
    return False


class _LeafTracer(fx.Tracer):
    """Child modules are leaves, except plain ``nn.Sequential``s and the ``expanded`` wrappers."""

    def __init__(self, expanded: set[str]) -> None:
        super().__init__(autowrap_functions=tuple(getattr(torch, name) for name in _SIZED_FACTORIES))
        self._autowrap_search.append(torch)  # torch.ones(t, t) with a traced t: recorded as one call
        self.expanded = expanded

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.expanded and not _is_plain_sequential(m)

    def create_arg(self, a: Any) -> Any:
        """fx records a dict subclass as a plain dict; a forward returning one (Hugging
        Face's ``ModelOutput``, read as ``out.logits``) gets it rebuilt as its own type."""
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, fx.immutable_collections.immutable_dict):
            return self.create_node("call_function", _rebuilder(type(a)), (super().create_arg(dict(a)),), {})
        return super().create_arg(a)

    def to_bool(self, obj: fx.Proxy) -> bool:
        frame = _user_frame(inspect.currentframe())
        if frame is not None and _is_assert(frame):
            where = _place(frame.f_code.co_filename, frame.f_lineno)
            self.create_proxy("call_function", torch._assert, (obj, f"assertion at {where} failed"), {})
            return True
        where = _place(frame.f_code.co_filename, frame.f_lineno) if frame is not None else "forward"
        raise _TraceStop("a traced value decides Python control flow (data-dependent if/while)", where)


def _rebuilder(kind: type) -> Callable[[dict], Any]:
    """A function making a ``kind`` (a dict subclass) from a dict, named for fx's code."""

    def rebuild(items: dict) -> Any:
        return kind(items)

    rebuild.__name__ = rebuild.__qualname__ = f"as_{kind.__name__}"
    return rebuild


def _failure_place(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR) and os.path.abspath(f.filename) != _THIS_FILE]
    return _place(frames[-1].filename, frames[-1].lineno) if frames else "forward"


def _source_line(where: str) -> str:
    filename, _, line = where.rpartition(":")
    try:
        with open(filename) as stream:
            text = stream.readlines()[int(line) - 1].strip()
    except (OSError, ValueError, IndexError):
        return ""
    return f" (`{text}`)" if text else ""


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of the module's own ``forward`` (its class's, without ``self``): what
    ``self(...)`` in a step binds to, and what a traced program's inputs follow."""
    signature = inspect.signature(type(module).forward)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _concrete_arguments(module: nn.Module, num_inputs: int) -> dict[str, Any]:
    """``forward``'s parameters after the ``num_inputs`` the pipeline passes, at their defaults."""
    parameters = list(forward_signature(module).parameters.values())
    concrete: dict[str, Any] = {}
    for parameter in parameters[num_inputs:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is parameter.empty:
            raise _TraceStop(f"forward's argument '{parameter.name}' has no default and self(...) does not pass it", _forward_place(module))
        concrete[parameter.name] = parameter.default
    return concrete


def _snapshot(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    return [(m, dict(m.__dict__)) for m in module.modules()]


def _restore(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Undo attribute assignments made by user code while it ran under the tracer (a
    ``self.mask = ...`` cache would otherwise keep a traced placeholder)."""
    for m, before in saved:
        for key in [key for key in m.__dict__ if key not in before]:
            del m.__dict__[key]
        for key, value in before.items():
            if m.__dict__.get(key) is not value:
                m.__dict__[key] = value


def _trace_once(module: nn.Module, num_inputs: int, expanded: set[str]) -> fx.GraphModule:
    tracer = _LeafTracer(expanded)
    saved = _snapshot(module)
    try:
        graph = tracer.trace(module, concrete_args=_concrete_arguments(module, num_inputs))
    finally:
        _restore(saved)
    for node in graph.nodes:  # else the generated code would register the factory with fx.wrap
        node.meta.pop("is_wrapped", None)
    traced = fx.GraphModule(tracer.root, graph, class_name=f"{type(module).__name__}Program")
    for node in list(traced.graph.nodes):
        if node.op == "placeholder" and node.target.startswith("*"):
            raise _TraceStop("forward takes *args/**kwargs", _forward_place(module))
    placeholders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    for node in placeholders[num_inputs:]:
        _erase_default_guards(traced.graph, node)
        if node.users:
            raise _TraceStop(f"forward's defaulted argument '{node.target}' is used as a value", _forward_place(module))
        traced.graph.erase_node(node)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _erase_default_guards(graph: fx.Graph, node: fx.Node) -> None:
    """Remove fx's checks that a parameter left at its default got that default: the
    pipeline never passes it. A None default is checked by ``_assert_is_none(x)``, any
    other by ``torch._assert(x == default)``."""
    for user in list(node.users):
        if user.target is _assert_is_none:
            graph.erase_node(user)
        elif user.target is operator.eq and len(user.users) == 1 and next(iter(user.users)).target is torch._assert:
            graph.erase_node(next(iter(user.users)))
            graph.erase_node(user)


def _delegate(traced: fx.GraphModule, expanded: set[str]) -> str | None:
    """The one child module a forward calls, when it is the user's own wrapper around
    children of its own (a torch module such as ``nn.TransformerEncoder`` stays a leaf)."""
    calls = [node for node in traced.graph.nodes if node.op == "call_module"]
    if len(calls) != 1 or calls[0].target in expanded:
        return None
    child = traced.get_submodule(calls[0].target)
    if type(child).__module__.startswith("torch.") or not any(True for _ in child.children()):
        return None
    return calls[0].target


def _trace_expanded(module: nn.Module, num_inputs: int) -> fx.GraphModule:
    expanded: set[str] = set()
    while True:
        traced = _trace_once(module, num_inputs, expanded)
        wrapper = _delegate(traced, expanded)
        if wrapper is None:
            return traced
        expanded.add(wrapper)


@contextmanager
def _in_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """``module.train(training)``, then every submodule back in its own mode (a frozen
    part the user keeps in evaluation mode stays there)."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _same_in_both_modes(module: nn.Module, num_inputs: int, traced: fx.GraphModule) -> None:
    """The program is traced in the module's mode; one that reads ``self.training`` (e.g.
    ``F.dropout(x, training=self.training)`` in forward) would run its training branch in
    evaluation too, so it is refused."""
    with _in_mode(module, not module.training):
        other = _trace_expanded(module, num_inputs)
    if other.code != traced.code:
        raise _TraceStop("forward computes differently in training and evaluation mode (it reads self.training)", _forward_place(module))


def _kind_of(value: Any, rows: int) -> tuple[bool, bool]:
    """(per-sample tensor, plain Python value) for one sample run."""
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1 and value.shape[0] == rows, False
    leaves = torch.utils._pytree.tree_leaves(value)
    return False, not any(isinstance(leaf, (torch.Tensor, nn.Module)) for leaf in leaves)


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, rows: int) -> None:
        super().__init__(module)
        self.rows = rows
        self.kinds: dict[str, tuple[bool, bool]] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.kinds[n.name] = _kind_of(value, self.rows)
        return value


def _value_kinds(module: nn.Module, traced: fx.GraphModule, samples: Sequence[tuple]) -> dict[str, ValueKind]:
    """Run the program on each sample (evaluation mode, no autograd, RNG put back) and
    keep, per value, whether it was per-sample in every run and a plain value in all."""
    runs = []
    with _in_mode(module, False), torch.no_grad(), torch.random.fork_rng(devices=[]):
        for args in samples:
            recorder = _Recorder(traced, _rows(args))
            recorder.run(*args)
            runs.append(recorder.kinds)
    return {name: ValueKind(per_sample=all(run[name][0] for run in runs), scalar=all(run[name][1] for run in runs)) for name in runs[0]}


def _rows(args: tuple) -> int:
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    raise DappleConfigError("forward inputs", "contain no tensor with a batch dimension", "call self(x) with batch-first tensors")


def trace_forward(module: nn.Module, samples: Sequence[tuple]) -> TracedProgram:
    """Trace ``module.forward`` for calls with ``samples[0]``'s positional arguments.

    ``samples`` are the positional arguments of ``self(...)`` on slices of the batch of
    different row counts (two, where the batch has them); running the program on each
    tells per-sample values (first dimension = rows in every run) from the rest. A
    failure is one ``DappleConfigError`` with what failed, where and the manual fix.
    """
    num_inputs = len(samples[0])
    name = type(module).__name__
    try:
        traced = _trace_expanded(module, num_inputs)
        _same_in_both_modes(module, num_inputs, traced)
        kinds = _value_kinds(module, traced, samples)
    except _TraceStop as stop:
        raise DappleConfigError(f"{name}.forward", f"cannot be traced into a layer list: {stop.what} at {stop.where}{_source_line(stop.where)}", LAYER_LIST_FIX) from None
    except DappleConfigError:
        raise
    except Exception as exc:
        where = _failure_place(exc)
        what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        raise DappleConfigError(f"{name}.forward", f"cannot be traced into a layer list: {what} at {where}{_source_line(where)}", LAYER_LIST_FIX) from None
    return TracedProgram(traced, num_inputs, kinds, name)
