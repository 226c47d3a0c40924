"""A model made in ``configure_model`` is built on the meta device; each rank materializes
only its stage, with the values building the whole model on the CPU would give.

A pipeline exists for models that do not fit one process (DAPPLE sec. 4: stages because the
model need not fit a device), so no rank may build the whole model. ``configure_model`` runs
under ``MetaBuild`` (and so does ``Trainer.init_module(empty_init=True)``): every tensor is
made on the meta device (no memory), and a ``TorchFunctionMode`` records how each parameter
and buffer gets its values:

* the factory that made it (``torch.zeros``, ``torch.empty``, ``torch.randn``, ...), and what
  was computed from such tensors (a rotary table's ``arange``, ``pow``, ``reciprocal``; a
  buffer that is a view, such as BERT's ``position_ids``, ``arange(n).expand(1, -1)``);
* every in-place write to it, through ``.data`` and views (``reset_parameters``' and
  ``nn.init``'s ``uniform_``/``kaiming_uniform_``/``zero_``, Hugging Face's
  ``weight.data.normal_()``, ``weight.data[padding_idx].zero_()``).

A random operation draws from torch's CPU generator as it would on the CPU: it is run for
real on a scratch tensor of the same shape (one buffer, reused), so the generator ends the build
where a real build leaves it (the data order drawn later is plain Lightning's), and the
generator's state before it is kept. Once the plan is known, ``materialize`` replays each
owned tensor's record on the CPU, every random operation from its recorded state: the
values are those of the whole model built on the CPU, whatever the other stages hold and in
whatever order the tensors are made (``plan="auto"`` profiles one layer made at a time,
``meta_profile.py``), and a rank's peak holds its stage plus the largest single tensor.
Parameters are found by their attribute paths (a dtype conversion such as ``64-true``
replaces buffer objects after the build); tied parameters stay one tensor. A tensor whose
values a pretrained checkpoint holds is read from it instead (``hf_weights.py``).

Hugging Face models are recorded like any other: ``PreTrainedModel.init_weights`` asks
where modules are made before it initialises, and on the meta device it would skip its
``_init_weights``; the build tells it the CPU, so its initialisation runs on the meta
tensors and is recorded (``from_pretrained``, which cannot load into the build, is refused
with the fix: ``from_config`` and ``DappleStrategy(pretrained=directory)``).

The record is numbered by the order tensors were made, so it can be pickled with the module
(the spawn launcher sends a module made under ``Trainer.init_module`` and the strategy to
the ranks in one pickle) and names the module's tensors there at ``finish``.

What cannot be replayed is refused at set-up, on every rank alike, with the fix (build the
model in ``__init__``): a value copied in from a tensor of real data, a tensor whose values
come from nowhere recorded (``torch.empty`` never written), unless a pretrained directory
gives it its values.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_dapple.errors import DappleConfigError
from lightning_dapple.profile.hf_layers import is_hf_model

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
_SAME = {_DATA, torch.Tensor.detach, torch.detach}  # aliases of the whole tensor (nn.Buffer detaches what it wraps)
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
        if func is torch.tensor:
            asker = _hugging_face_asking()
            if asker == "check_and_set_device_map":  # from_pretrained
                raise DappleConfigError(
                    "from_pretrained",
                    "is called while the model is built on the meta device (configure_model, Trainer.init_module(empty_init=True)), "
                    "where no weights can be loaded",
                    "make the model from its config there (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))) "
                    "and pass DappleStrategy(pretrained=directory): each rank then reads only its own stage's weights",
                )
            if asker is not None:
                return func(*args, **{**kwargs, "device": "cpu"})
        return self.build._record(func, args, kwargs)


def _hugging_face_asking() -> str | None:
    """Which function asked Hugging Face's ``get_torch_context_manager_or_global_device``
    (through this ``torch.tensor([])``), or None when the call is not that question.
    ``PreTrainedModel.init_weights`` asks before initialising: told the meta device, it skips
    ``_init_weights``, whose writes the build must record, so it is told the CPU.
    ``from_pretrained`` asks too (``check_and_set_device_map``): it cannot load into the build."""
    caller = sys._getframe(2)
    if caller.f_code.co_name != "get_torch_context_manager_or_global_device" or caller.f_globals.get("__name__") != "transformers.modeling_utils":
        return None
    return caller.f_back.f_code.co_name if caller.f_back is not None else ""


Source = Callable[[list[str], torch.Tensor], "torch.Tensor | None"]
"""Values read from elsewhere for a tensor known by these attribute paths (a checkpoint's),
given its meta tensor; None: replay the record."""


class MetaBuild:
    """Records a build on the meta device (module docstring); ``materialize`` replays it.

    Roots are numbered in the order they were made and recorded tensors are kept with their
    root, so the record survives pickling with the module (the spawn launcher sends both to
    the ranks in one pickle; ``__setstate__`` finds the tensors again by identity)."""

    def __init__(self) -> None:
        self.roots: dict[int, _Root] = {}
        self._tracked: list[tuple[torch.Tensor, int, tuple]] = []  # every recorded meta tensor, its root and view steps
        self._where: dict[int, tuple[int, tuple]] = {}  # id(tensor) -> (its root, its steps), from _tracked
        self.paths: dict[str, tuple[int, tuple, bool]] = {}  # attribute path -> (root, view steps, is a parameter), at the build's end
        self.problems: list[tuple[str, str]] = []  # (attribute path, what cannot be replayed)
        self._inside = False  # recording one operation: what it calls itself is not recorded
        self._scratch: torch.Tensor | None = None  # the buffer random writes run on while recording
        self.default_dtype = torch.get_default_dtype()  # the build's (a precision's context sets it), for the replay

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_where")
        state["_scratch"] = None
        # what a module can hold (parameters, tensors without autograd); views of parameters
        # are only needed while the build runs, and some cannot be pickled
        state["_tracked"] = [entry for entry in self._tracked if isinstance(entry[0], nn.Parameter) or not entry[0].requires_grad]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._where = {id(tensor): (root, chain) for tensor, root, chain in self._tracked}

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

            init.recorded_by_meta_build = True  # type: ignore[attr-defined]
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
            self._scratch = None

    def _resolve(self, tensor: torch.Tensor) -> tuple[int, tuple] | None:
        return self._where.get(id(tensor))

    def _track(self, tensor: torch.Tensor, root: int, chain: tuple) -> None:
        self._tracked.append((tensor, root, chain))  # kept alive: its id stays its own
        self._where[id(tensor)] = (root, chain)

    def _alias(self, view: torch.Tensor, source: torch.Tensor, step: tuple) -> None:
        resolved = self._resolve(source)
        if resolved is not None:
            self._track(view, resolved[0], resolved[1] + step)

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
        if getattr(func, "recorded_by_meta_build", False):  # nn.init's own dispatch names the wrapper: keep the function
            func = func.__wrapped__
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
                self._alias(out, args[0], () if func in _SAME else ((func, args[1:], kwargs),))
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
            scratch = _replay_chain(self._scratch_like(record.shape, record.dtype), chain)
            torch.set_rng_state(rng)
            _call(op, scratch, lambda ref: torch.empty(0))

    def _record_made(self, func: Any, args: tuple, kwargs: dict, out: torch.Tensor, rng: torch.Tensor) -> None:
        try:
            op_args, op_kwargs = pytree.tree_map(self._ref, (args, kwargs))
        except (_Unrecorded, _RealData) as exc:
            self._new_root(out, _Root(None, out.shape, out.dtype, problem=exc.why(func)))
            return
        if func in _FACTORIES:  # made on the CPU, in the dtype the build made it in
            op_kwargs = {**op_kwargs, "device": "cpu", "dtype": out.dtype}
        self._new_root(out, _Root(_Op(func, op_args, op_kwargs, rng), out.shape, out.dtype))
        if _draws(func):  # a random factory: draw for real, as the CPU build would
            torch.set_rng_state(rng)
            func(*args, **{**kwargs, "device": "cpu"})

    def _scratch_like(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` on one buffer the build reuses: a write draws
        the same numbers wherever its tensor lies, and one buffer, freed whole when the build
        ends, leaves no freed blocks behind in the process's heap (a scratch tensor per write
        left the heap as large as the whole model)."""
        size = torch.Size(shape).numel() * dtype.itemsize
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, device="cpu")
        return self._scratch[:size].view(dtype).view(shape)

    def _new_root(self, tensor: torch.Tensor, record: _Root) -> None:
        key = len(self.roots)
        self.roots[key] = record
        self._track(tensor, key, ())

    def finish(self, module: nn.Module) -> None:
        """Note where each parameter and buffer of ``module`` came from (by attribute path:
        later conversions replace tensor objects), once the build has ended; again after a
        later build into the same record (``configure_model`` after ``Trainer.init_module``)."""
        self.paths, self.problems = {}, []
        # a Hugging Face model whose own initialisation did not run while recorded (a transformers
        # release that asks where modules are made some other way) would get torch's defaults
        skipped = [name for name, sub in module.named_modules() if is_hf_model(sub) and not getattr(sub, "_is_hf_initialized", False)]
        tables = [("param", name, t) for name, t in module.named_parameters(remove_duplicate=False)]
        tables += [("buffer", name, t) for name, t in module.named_buffers(remove_duplicate=False)]
        for kind, name, tensor in tables:
            if not tensor.is_meta:
                continue
            resolved = self._resolve(tensor)
            if resolved is None:
                self.problems.append((name, f"{name} gets its values in a way the build did not record (a conversion after the build, "
                                      "such as .double(), makes new buffers: leave it to the Trainer's precision)"))
                continue
            root = self.roots[resolved[0]]
            if any(not path or name.startswith(path + ".") for path in skipped):
                self.problems.append((name, f"{name}: Hugging Face's initialisation of its model did not run while it was recorded"))
            elif root.problem is not None:
                self.problems.append((name, f"{name}: {root.problem}"))
            elif root.made is not None and root.made.func in (torch.empty, torch.empty_like) and not _written_whole(root):
                self.problems.append((name, f"{name} is made with torch.empty and never written whole"))
            self.paths[name] = (resolved[0], resolved[1], kind == "param")

    # -- replaying ---------------------------------------------------------------------
    def check(self, owner: str, loaded: Callable[[str], bool] = lambda name: False) -> None:
        """Refuse a build that cannot be replayed, on every rank alike; a tensor whose values
        are ``loaded`` from a checkpoint needs no replay."""
        problems = [text for name, text in self.problems if not loaded(name)]
        if problems:
            raise DappleConfigError(
                f"{owner}.configure_model",
                f"builds the model on the meta device so that each rank makes only its stage, but {problems[0]}"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
                "initialise parameters with in-place writes (reset_parameters(), torch.nn.init, .data.normal_()) on "
                "tensors made with torch factories, or build the model in __init__ (then every rank builds it whole "
                "before keeping its stage); a Hugging Face model: AutoModel*.from_config(config) with "
                "DappleStrategy(pretrained=directory) instead of from_pretrained",
            )

    def materialize(self, module: nn.Module, owned: Callable[[torch.Tensor], bool], source: Source | None = None) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Give every parameter and buffer of ``module`` that ``owned`` accepts (or that shares
        its tensor with one it accepts: a tie stays one tensor) its values on the CPU: read by
        ``source`` where it has them (a pretrained checkpoint), else replayed from the record;
        the others stay on the meta device. The generator's state is put back afterwards.
        Returns what was replaced: (holder, attribute, its meta tensor)."""
        places: dict[tuple[int, int], list[tuple[nn.Module, str, str, torch.Tensor]]] = {}  # one tensor -> where it is held
        chains: dict[tuple[int, int], tuple] = {}
        for name, (root, chain, _) in self.paths.items():
            path, _, attribute = name.rpartition(".")
            holder = module.get_submodule(path) if path else module
            current = getattr(holder, attribute)
            key = (root, id(current) if chain else 0)  # a root's own tensor is one tensor wherever held; a view is its own
            chains[key] = chain
            places.setdefault(key, []).append((holder, attribute, name, current))
        state, default_dtype = torch.get_rng_state(), torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        memo: dict[tuple[int, int], torch.Tensor] = {}
        replaced: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for (root, view), where in places.items():
                chain = chains[(root, view)]
                if not any(current.is_meta and owned(current) for _, _, _, current in where):
                    continue
                read = source([name for _, _, name, _ in where], where[0][3]) if source is not None else None
                made = read if read is not None else _replay_chain(self._value(root, len(self.roots[root].writes), memo), chain)
                values: dict[tuple[torch.dtype, bool], torch.Tensor] = {}
                for holder, attribute, _, current in where:
                    is_param = attribute in holder._parameters
                    key = (current.dtype, is_param)
                    if key not in values:  # one tensor per root (a tie stays one parameter)
                        value = made.to(current.dtype)
                        values[key] = nn.Parameter(value, requires_grad=current.requires_grad) if is_param else value
                    replaced.append((holder, attribute, current))
                    (holder._parameters if is_param else holder._buffers)[attribute] = values[key]
        finally:
            torch.set_rng_state(state)
            torch.set_default_dtype(default_dtype)
        return replaced

    @contextlib.contextmanager
    def materialized(self, module: nn.Module, owned: Callable[[torch.Tensor], bool], source: Source | None = None) -> Iterator[None]:
        """``materialize`` for a while: the meta tensors are put back afterwards (profiling a
        model built on the meta device one layer at a time, ``meta_profile.py``)."""
        replaced = self.materialize(module, owned, source)
        try:
            yield
        finally:
            for holder, attribute, original in replaced:
                (holder._parameters if attribute in holder._parameters else holder._buffers)[attribute] = original

    def layer_by_layer(self, module: nn.Module, source: Source | None = None) -> Callable[[nn.Module], ContextManager[None]]:
        """``real(layer)``: that layer of ``module`` made real for a while (``materialized``)."""

        def real(layer: nn.Module) -> ContextManager[None]:
            mine = {id(tensor) for tensor in (*layer.parameters(), *layer.buffers())}
            return self.materialized(module, lambda tensor: id(tensor) in mine, source)

        return real

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


class _Target:
    """The written tensor's place in a write's arguments (one object, also after unpickling)."""

    def __reduce__(self) -> str:
        return "_TARGET"


_TARGET = _Target()


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
