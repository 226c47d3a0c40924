"""A model made in ``configure_model`` is built on the meta device; each rank materializes
only its stage, with the values building the whole model on the CPU would give.

A pipeline exists for models that do not fit one process (DAPPLE sec. 4: stages because the
model need not fit a device), so no rank may build the whole model. ``configure_model`` runs
under ``MetaBuild``: every tensor is made on the meta device (no memory), and a
``TorchFunctionMode`` records how each parameter and buffer gets its values:

* the factory that made it (``torch.zeros``, ``torch.empty``, ``torch.randn``, ...), and what
  was computed from such tensors (a rotary table's ``arange``, ``pow``, ``reciprocal``);
* every in-place write to it, through ``.data`` and views (``reset_parameters``' and
  ``nn.init``'s ``uniform_``/``kaiming_uniform_``/``zero_``, Hugging Face's
  ``weight.data.normal_()``, ``weight.data[padding_idx].zero_()``).

A random operation draws from torch's CPU generator as it would on the CPU: it is run for
real on a scratch tensor of the same shape (freed at once), so the generator ends the build
where a real build leaves it (the data order drawn later is plain Lightning's), and the
generator's state before it is kept. Once the plan is known, ``materialize`` replays each
owned tensor's record on the CPU, every random operation from its recorded state: the
values are those of the whole model built on the CPU, whatever the other stages hold, and a
rank's peak holds its stage plus the largest single tensor. Parameters are found by their
attribute paths (a dtype conversion such as ``64-true`` replaces tensor objects after the
build); tied parameters stay one tensor.

What cannot be replayed is refused at set-up, on every rank alike, with the fix (build the
model in ``__init__``): a value copied in from a tensor of real data, a tensor whose values
come from nowhere recorded (``torch.empty`` never written), a Hugging Face model (its
initialisation skips meta tensors in ways the record cannot see).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError

__all__ = ["MetaBuild", "built_on_meta"]

_FACTORIES = {
    torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor,
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.normal, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.empty_like, torch.rand_like, torch.randn_like, torch.randint_like, torch.as_tensor,
}
_VIEWS = {
    torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.narrow, torch.Tensor.select, torch.Tensor.t, torch.Tensor.transpose,
    torch.Tensor.permute, torch.Tensor.diagonal, torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.detach,
    torch.Tensor.view_as, torch.Tensor.expand, torch.Tensor.unflatten, torch.narrow, torch.select, torch.t, torch.transpose,
    torch.diagonal, torch.unsqueeze, torch.squeeze, torch.detach,
}
_DATA = torch.Tensor.data.__get__  # type: ignore[attr-defined]
_IGNORED = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.__len__, torch.Tensor.shape.__get__}  # type: ignore[attr-defined]


@dataclass
class _Op:
    """One recorded operation: ``func`` with ``args``/``kwargs`` whose recorded meta tensors
    are ``_Ref``s; ``rng`` is the CPU generator's state before it."""

    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    rng: torch.Tensor


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor in an operation's arguments: its root, the view steps from the root,
    and how many of the root's writes had happened at that point."""

    root: int
    chain: tuple
    writes: int


@dataclass
class _Root:
    """A tensor that owns its values: how it was made, then the writes to it in order."""

    made: _Op | None
    shape: torch.Size
    dtype: torch.dtype
    writes: list[tuple[tuple, _Op]] = field(default_factory=list)  # (view chain, op)
    problem: str | None = None


class _Recorder(TorchFunctionMode):
    def __init__(self, build: "MetaBuild") -> None:
        super().__init__()
        self.build = build

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED or self.build._inside:
            return func(*args, **kwargs)
        return self.build._record(func, args, kwargs)


class MetaBuild:
    """Records a build on the meta device (module docstring); ``materialize`` replays it."""

    def __init__(self) -> None:
        self.roots: dict[int, _Root] = {}
        self.views: dict[int, tuple[int, tuple]] = {}  # a view or a .data alias -> (its root, its steps)
        self._alive: list[torch.Tensor] = []  # recorded meta tensors kept alive (their ids stay theirs)
        self.paths: dict[str, tuple[int, bool]] = {}  # attribute path -> (root, is a parameter), at the build's end
        self.problems: list[str] = []
        self._inside = False  # recording one operation: what it calls itself is not recorded
        self.default_dtype = torch.get_default_dtype()  # the build's (a precision's context sets it), for the replay

    # -- recording -------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator["MetaBuild"]:
        """Build on the meta device and record (``configure_model``'s context)."""
        original_new = nn.Parameter.__new__
        build = self

        def parameter_new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
            param = original_new(cls, data, requires_grad)
            if isinstance(data, torch.Tensor) and data.is_meta:
                build._alias(param, data, ())
            return param

        # torch.nn.init's functions, some of which skip meta tensors without dispatching
        # (trunc_normal_): recorded as the writes they are
        inits = {name: getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")}

        def recorded(func: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(func)
            def init(*args: Any, **kwargs: Any) -> Any:
                target = kwargs.get("tensor", args[0] if args else None)
                if isinstance(target, torch.Tensor) and target.is_meta and not build._inside:
                    return build._record(func, args, kwargs)
                return func(*args, **kwargs)

            return init

        nn.Parameter.__new__ = parameter_new  # type: ignore[method-assign]
        for name, func in inits.items():
            setattr(nn.init, name, recorded(func))
        try:
            self.default_dtype = torch.get_default_dtype()
            with torch.device("meta"), _Recorder(self):
                yield self
        finally:
            nn.Parameter.__new__ = original_new  # type: ignore[method-assign]
            for name, func in inits.items():
                setattr(nn.init, name, func)

    def _resolve(self, tensor: torch.Tensor) -> tuple[int, tuple] | None:
        key = id(tensor)
        if key in self.views:
            return self.views[key]
        if key in self.roots:
            return key, ()
        return None

    def _alias(self, view: torch.Tensor, source: torch.Tensor, step: tuple) -> None:
        resolved = self._resolve(source)
        if resolved is None:
            return
        self._alive.append(view)
        self.views[id(view)] = (resolved[0], resolved[1] + step)

    def _ref(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            resolved = self._resolve(value)
            if resolved is None:
                raise _Unrecorded()
            return _Ref(resolved[0], resolved[1], len(self.roots[resolved[0]].writes))
        if isinstance(value, torch.Tensor):
            raise _RealData()
        return value

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        rng = torch.get_rng_state()
        self._inside = True
        try:
            out = func(*args, **kwargs)
            self._note(func, args, kwargs, out, rng)
        finally:
            self._inside = False
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any, rng: torch.Tensor) -> None:
        if func is _DATA or func in _VIEWS:
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                self._alias(out, args[0], () if func is _DATA else ((func, args[1:], kwargs),))
            return
        target = _written(func, args, kwargs)
        if target is not None and target.is_meta:
            self._record_write(func, args, kwargs, target, rng)
        elif isinstance(out, torch.Tensor) and out.is_meta:
            self._record_made(func, args, kwargs, out, rng)

    def _record_write(self, func: Any, args: tuple, kwargs: dict, target: torch.Tensor, rng: torch.Tensor) -> None:
        resolved = self._resolve(target)
        if resolved is None:
            return  # a write to a tensor that no parameter or buffer comes from
        root, chain = resolved
        record = self.roots[root]
        try:
            op_args, op_kwargs = pytree.tree_map(lambda v: _TARGET if v is target else self._ref(v), (args, kwargs))
        except (_Unrecorded, _RealData) as exc:
            record.problem = record.problem or exc.why(func)
            return
        op = _Op(func, op_args, op_kwargs, rng)
        record.writes.append((chain, op))
        if _draws(func):  # advance the generator as the real write would: the same write on a scratch tensor
            scratch = _replay_chain(torch.empty(record.shape, dtype=record.dtype, device="cpu"), chain)
            torch.set_rng_state(rng)
            _call(op, scratch, lambda ref: torch.empty(0))

    def _record_made(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor, rng: torch.Tensor) -> None:
        try:
            op_args, op_kwargs = pytree.tree_map(self._ref, (args, kwargs))
        except (_Unrecorded, _RealData) as exc:
            self._alive.append(out)
            self.roots[id(out)] = _Root(None, out.shape, out.dtype, problem=exc.why(func))
            return
        if func in _FACTORIES:  # made on the CPU, in the dtype the build made it in
            op_kwargs = {**op_kwargs, "device": "cpu", "dtype": out.dtype}
        self._alive.append(out)
        self.roots[id(out)] = _Root(_Op(func, op_args, op_kwargs, rng), out.shape, out.dtype)
        if _draws(func):  # a random factory: draw for real, as the CPU build would
            torch.set_rng_state(rng)
            func(*args, **{**kwargs, "device": "cpu"})

    def finish(self, module: nn.Module) -> None:
        """Note where each parameter and buffer of ``module`` came from (by attribute path:
        later conversions replace tensor objects), once the build has ended."""
        for name, sub in module.named_modules():
            if any(base.__name__ == "PreTrainedModel" and base.__module__.startswith("transformers.") for base in type(sub).__mro__):
                self.problems.append(
                    f"{name or 'the module'} is a Hugging Face model ({type(sub).__name__}), initialised by its own code in ways "
                    "the build does not record"
                )
                return
        tables = [("param", name, t) for name, t in module.named_parameters(remove_duplicate=False)]
        tables += [("buffer", name, t) for name, t in module.named_buffers(remove_duplicate=False)]
        for kind, name, tensor in tables:
            if not tensor.is_meta:
                continue
            resolved = self._resolve(tensor)
            if resolved is None or resolved[1]:
                self.problems.append(f"{name} gets its values in a way the build did not record")
                continue
            root = self.roots[resolved[0]]
            if root.problem is not None:
                self.problems.append(f"{name}: {root.problem}")
            elif root.made is not None and root.made.func in (torch.empty, torch.empty_like) and not _written_whole(root):
                self.problems.append(f"{name} is made with torch.empty and never written whole")
            self.paths[name] = (resolved[0], kind == "param")

    # -- replaying ---------------------------------------------------------------------
    def check(self, owner: str) -> None:
        """Refuse a build that cannot be replayed, on every rank alike."""
        if self.problems:
            raise DappleConfigError(
                f"{owner}.configure_model",
                f"builds the model on the meta device so that each rank makes only its stage, but {self.problems[0]}"
                + (f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""),
                "initialise parameters with in-place writes (reset_parameters(), torch.nn.init, .data.normal_()) on "
                "tensors made with torch factories, or build the model in __init__ (then every rank builds it whole "
                "before keeping its stage)",
            )

    def materialize(self, module: nn.Module, owned: Callable[[torch.Tensor], bool]) -> None:
        """Give every parameter and buffer of ``module`` that ``owned`` accepts (or that shares
        its tensor with one it accepts: a tie stays one tensor) its values, replayed on the
        CPU; the others stay on the meta device. The generator's state is put back afterwards."""
        places: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}  # root -> where its tensor is held
        for name, (root, _) in self.paths.items():
            path, _, attribute = name.rpartition(".")
            holder = module.get_submodule(path) if path else module
            places.setdefault(root, []).append((holder, attribute, getattr(holder, attribute)))
        state, default_dtype = torch.get_rng_state(), torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        memo: dict[tuple[int, int], torch.Tensor] = {}
        try:
            for root, where in places.items():
                if not any(owned(current) for _, _, current in where):
                    continue
                values: dict[tuple[torch.dtype, bool], torch.Tensor] = {}
                replayed = self._value(root, len(self.roots[root].writes), memo)
                for holder, attribute, current in where:
                    is_param = attribute in holder._parameters
                    key = (current.dtype, is_param)
                    if key not in values:  # one tensor per root (a tie stays one parameter)
                        value = replayed.to(current.dtype)
                        values[key] = nn.Parameter(value, requires_grad=current.requires_grad) if is_param else value
                    (holder._parameters if is_param else holder._buffers)[attribute] = values[key]
        finally:
            torch.set_rng_state(state)
            torch.set_default_dtype(default_dtype)

    def _value(self, root: int, writes: int, memo: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """The root's values after its first ``writes`` writes, replayed on the CPU."""
        key = (root, writes)
        if key in memo:
            return memo[key]
        record = self.roots[root]
        if record.made is None:
            tensor = torch.empty(record.shape, dtype=record.dtype, device="cpu")
        else:
            torch.set_rng_state(record.made.rng)
            tensor = _call(record.made, None, lambda ref: self._view_of(ref, memo))
        for chain, op in record.writes[:writes]:
            torch.set_rng_state(op.rng)
            _call(op, _replay_chain(tensor, chain), lambda ref: self._view_of(ref, memo))
        memo[key] = tensor
        return tensor

    def _view_of(self, ref: _Ref, memo: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        return _replay_chain(self._value(ref.root, ref.writes, memo).clone(), ref.chain)


def built_on_meta(module: nn.Module) -> bool:
    """Whether ``module`` holds tensors on the meta device (a ``MetaBuild`` not yet materialized)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


class _Unrecorded(Exception):
    def why(self, func: Any) -> str:
        return f"{_name(func)} reads a meta tensor the build did not record"


class _RealData(Exception):
    def why(self, func: Any) -> str:
        return f"{_name(func)} copies in values from a tensor of real data"


_TARGET = object()  # the written tensor's place in a write's arguments


def _name(func: Any) -> str:
    return getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))


def _written(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor an in-place operation writes (``t.uniform_()``, ``nn.init.zeros_(t)``,
    ``t[i] = v``), or None."""
    name = getattr(func, "__name__", "")
    if func is torch.Tensor.__setitem__ or (name.endswith("_") and not name.startswith("__")):
        first = kwargs.get("tensor", args[0] if args else None)
        return first if isinstance(first, torch.Tensor) else None
    return None


def _draws(func: Any) -> bool:
    """Whether ``func`` may draw from the generator (run for real while recording)."""
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", "") == "torch.nn.init" or any(
        word in name for word in ("rand", "normal", "uniform", "bernoulli", "exponential", "geometric", "cauchy", "random", "orthogonal", "sparse", "multinomial")
    )


def _written_whole(root: _Root) -> bool:
    """Whether a write fills the whole root before anything reads it."""
    return bool(root.writes) and root.writes[0][0] == () and getattr(root.writes[0][1].func, "__name__", "") != "__setitem__"


def _replay_chain(tensor: torch.Tensor, chain: tuple) -> torch.Tensor:
    for func, args, kwargs in chain:
        tensor = func(tensor, *args, **kwargs)
    return tensor


def _call(op: _Op, target: torch.Tensor | None, value_of: Callable[[_Ref], torch.Tensor]) -> Any:
    def real(value: Any) -> Any:
        if value is _TARGET:
            return target
        if isinstance(value, _Ref):
            return value_of(value)
        return value

    args, kwargs = pytree.tree_map(real, (op.args, op.kwargs), is_leaf=lambda v: isinstance(v, _Ref) or v is _TARGET)
    return op.func(*args, **kwargs)
