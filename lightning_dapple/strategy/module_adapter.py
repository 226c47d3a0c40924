"""How an ordinary LightningModule is driven stage by stage without changing its code.

A qualifying module keeps its layers in a sequence (``self.layers`` by default) and its
``forward`` applies them in order, or has no such sequence and gets the layer list traced
from its ``forward`` (``profile/traced_layers.py``); its ``training_step`` calls
``self(x)`` (or ``self(input_ids=..., attention_mask=...)``: keywords are bound to
``forward``'s parameters and handed on by position). The pipeline
then needs two things from user code (DAPPLE 5.2.1 builds per-stage graphs from the
model; here the module's own step functions are reused instead):

* on the first stage, the input of layer 0 for a batch slice: the step function is run
  with ``forward`` replaced by a hook that records its argument and stops the step;
* on the last stage, the loss (or validation/predict output) for a slice: the step
  function is run with ``forward`` answering with the stage's output.

``self.log`` calls made on the last stage are recorded here and replayed on every rank,
so loggers, the progress bar and callbacks on rank 0 (a first-stage rank) see them.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torchmetrics import Metric

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.trace import forward_signature
from lightning_dapple.profile.traced_layers import TracedLayers, finds_layers_from_forward, traced_layers


class _InputCaptured(Exception):
    """Raised by the capturing forward to stop a step once layer 0's input is known."""

    def __init__(self, value: Any) -> None:
        super().__init__("input captured")
        self.value = value


class FreedLayer(nn.Module):
    """Stands in for a layer that lives on another stage; calling it is a bug."""

    def __init__(self, index: int, stage: int) -> None:
        super().__init__()
        self.index = index
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise DappleConfigError(
            f"layer {self.index}",
            f"was called directly, but it lives on pipeline stage {self.stage} and this rank holds other layers "
            "(a step that calls a part of the model itself, such as self.head(...) or self.encoder(...), runs it outside the pipeline)",
            "call self(...) in training_step, validation_step, test_step and predict_step, which runs every layer on its stage; "
            "use the parts directly after fit, on the whole model rank 0 gets back",
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, on_stage={self.stage}"


def find_layers(module: nn.Module, path: str, samples: Callable[[], Sequence[tuple]] | None = None) -> nn.Module:
    """The layer sequence at attribute ``path`` (dotted), or a clear error.

    With ``samples`` (the positional arguments of ``self(...)`` at two batch sizes, made
    on demand), ``path="auto"`` or a module without the default ``layers`` attribute gets
    the layer list traced from its ``forward`` (``profile.traced_layers``)."""
    if samples is not None and finds_layers_from_forward(module, path):
        return traced_layers(module, samples())
    target: Any = module
    for part in path.split("."):
        if not hasattr(target, part):
            raise DappleConfigError(
                "DappleStrategy(layers=...)",
                f"{type(module).__name__} has no attribute '{path}' holding its layer sequence",
                "keep the layers in an nn.Sequential/nn.ModuleList (e.g. self.layers), pass DappleStrategy(layers='encoder.blocks'), "
                "or layers='auto' to trace them from forward",
            )
        target = getattr(target, part)
    if not isinstance(target, (nn.Sequential, nn.ModuleList)) or len(target) == 0:
        raise DappleConfigError(
            "DappleStrategy(layers=...)",
            f"'{path}' is a {type(target).__name__}, not a non-empty nn.Sequential or nn.ModuleList",
            "hold the layers in an nn.Sequential or nn.ModuleList",
        )
    return target


def check_parameters_in_layers(module: nn.Module, layers: nn.Module, path: str) -> None:
    """Every trained parameter of ``module`` must belong to a layer of the sequence (a stage
    owns it). A parameter several layers use (tied weights) is allowed: each stage holding
    one of those layers keeps a copy (``execute/tied.py``). Frozen parameters outside the
    layers (a distillation teacher the step calls under ``no_grad``) stay on every rank,
    untrained: no stage needs to own them."""
    inside = {id(p) for p in layers.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in inside and p.requires_grad]
    if outside and isinstance(layers, TracedLayers):
        raise DappleConfigError(
            "model parameters",
            f"{outside[:3]} are not used by forward, so no layer traced from it holds them and no pipeline stage would own them",
            "delete them or use them in forward",
        )
    if outside:
        raise DappleConfigError(
            "model parameters",
            f"{outside[:3]} live outside '{path}', so no pipeline stage would own them",
            f"move them into a layer of '{path}'",
        )


@contextlib.contextmanager
def forward_replaced(
    module: nn.Module, forward: Callable[..., Any], traced_inputs: Sequence[str] | None = None, step_name: str = "training_step"
) -> Iterator[None]:
    """Temporarily make ``module(...)`` call ``forward`` (instance attribute shadows the
    method) with the call's arguments in positional form (``positional_arguments``), so a
    step may call ``self(input_ids=ids, attention_mask=mask)`` as it would the model.

    With ``traced_inputs`` (the parameters a traced layer list takes), a call passing other
    arguments is refused: the program was traced for those and specialised to the others'
    defaults (a validation_step leaving out the ``labels`` the training call passed)."""

    def positional(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            args = positional_arguments(forward_signature(module), args, kwargs, type(module).__name__)
        if traced_inputs is not None and len(args) != len(traced_inputs):
            raise DappleConfigError(
                step_name,
                f"calls self(...) with {len(args)} argument(s), but the layer list was traced from forward on a call with "
                f"{len(traced_inputs)} ({', '.join(traced_inputs)}), and runs only that call",
                "pass the same arguments to self(...) in every step (by position or by keyword), or give the layer list by hand "
                "(DappleStrategy(layers='...'))",
            )
        return forward(*args)

    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = positional  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            module.forward = previous  # type: ignore[method-assign]
        else:
            del module.forward


def positional_arguments(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any], owner: str = "model") -> tuple:
    """The arguments of a ``self(...)`` call as the positional tuple that layer 0 (or the
    traced program's inputs) takes: keywords bound to forward's parameters by name, up to
    the last one given a value other than its default (an unpassed or defaulted trailing
    parameter is left to forward's default, as a positional call leaving it out would)."""
    if not kwargs:
        return args
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise DappleConfigError(f"self(...) in the step of {owner}", f"does not match forward{signature}: {exc}", "pass the arguments forward takes") from None
    values: list[Any] = []
    given = len(args)
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            values.extend(bound.arguments.get(parameter.name, ()))
            continue
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            require(
                parameter.name not in bound.arguments,
                f"self(...) in the step of {owner}",
                f"passes '{parameter.name}', which forward{signature} takes only by keyword (or in **kwargs), while the pipeline "
                "hands layer 0 its inputs by position",
                f"make '{parameter.name}' a positional parameter of forward",
            )
            continue
        value = bound.arguments.get(parameter.name, parameter.default)
        values.append(value)
        if parameter.name in bound.arguments and value is not parameter.default:
            given = max(given, len(values))
    return tuple(values[:given])


def capture_call(module: nn.Module, step: Callable[[], Any], traced_inputs: Sequence[str] | None = None, step_name: str = "training_step") -> tuple:
    """Run ``step`` until it calls ``self(...)``; return that call's arguments in
    positional form (``forward_replaced``)."""

    def capturing(*args: Any) -> Any:
        raise _InputCaptured(args)

    with forward_replaced(module, capturing, traced_inputs, step_name):
        try:
            step()
        except _InputCaptured as captured:
            return captured.value
    raise DappleConfigError(
        "training_step", "returned without calling self(...)", "compute the model output with self(x) inside the step"
    )


def capture_input(module: nn.Module, step: Callable[[], Any], traced_inputs: Sequence[str] | None = None, step_name: str = "training_step") -> Any:
    """Run ``step`` until it calls ``self(x)``; return ``x`` (a tuple if several args)."""
    args = capture_call(module, step, traced_inputs, step_name)
    return args[0] if len(args) == 1 else args


def key_owners(module: nn.Module, layers: nn.Module) -> dict[str, int | None]:
    """Each state-dict key of the whole module -> index of the layer holding that tensor
    (None: outside the layers).

    Decided by tensor identity, not by key prefix, so a module that reaches its layers by
    two paths (``self.model = ...; self.layers = self.model.layers``) has both keys owned
    by the layer's stage.
    """
    holder: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for tensor in (*layer.parameters(), *layer.buffers()):
            holder.setdefault(id(tensor), index)
    return {key: holder.get(id(value)) for key, value in module.state_dict(keep_vars=True).items()}


def state_aliases(module: nn.Module, layers: nn.Module) -> dict[str, str]:
    """State-dict keys of ``module`` that name a tensor another key names too -> that key.

    A tied weight (``head.weight`` is ``embed.weight``) or a second path to a layer gives
    one tensor several keys. The checkpoint holds it once, under the canonical key: the one
    under the first layer holding the tensor (so that layer's stage has it), then the
    first in state-dict order; every other key is an alias of it.
    """
    layer_of: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for sub in layer.modules():
            layer_of.setdefault(id(sub), index)
    keys_of: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        keys_of.setdefault(id(value), []).append(key)

    def rank(key: str, position: int) -> tuple[int, int]:
        path = key.rpartition(".")[0]
        index = layer_of.get(id(module.get_submodule(path) if path else module))
        return (index if index is not None else len(layers), position)

    aliases: dict[str, str] = {}
    for keys in keys_of.values():
        if len(keys) > 1:
            canonical = min(keys, key=lambda key: rank(key, keys.index(key)))
            aliases.update({key: canonical for key in keys if key != canonical})
    return aliases


def module_home(module: nn.Module) -> torch.device:
    """Where the module's tensors are now (the CPU for a module with none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def loss_of(output: Any) -> torch.Tensor:
    """The loss tensor of a step's return value (a tensor or a dict with 'loss')."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if output is None:
        raise DappleConfigError(
            "training_step",
            "returned None, which asks Lightning to skip the batch; on a pipeline the step's loss is made on the last stage, "
            "after the other stages already ran the batch, so it cannot be skipped there",
            "leave such batches out of the DataLoader (a sampler or collate_fn that drops them), or return a loss for every batch",
        )
    raise DappleConfigError(
        "training_step", f"returned {type(output).__name__}", "return the loss tensor or a dict with a 'loss' tensor"
    )


# per module: id of each torchmetrics Metric it holds -> its submodule path
_METRIC_PATHS: "weakref.WeakKeyDictionary[nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


@dataclass
class LoggedValue:
    """One name's values of a step: the sum of value x slice weight (a float64 tensor where
    the value was logged, or a float), and the sum of the weights."""

    weighted_sum: torch.Tensor | float
    weight: float
    kwargs: dict[str, Any]


Logs = dict[str, tuple["torch.Tensor | float", float, dict[str, Any]]]


def combination(kwargs: dict[str, Any]) -> str:
    """How the micro-batch slices' values of one ``self.log`` make the step's value: by its
    ``reduce_fx`` where that is max, min or sum (the batch's max is the slices' max, a count
    over the batch their sum), else the row-weighted mean."""
    fx = kwargs.get("reduce_fx", "mean")
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
    return name if name in ("max", "min", "sum") else "mean"


def combination_notice(name: str, kwargs: dict[str, Any], micro_batches: int, replicas: int) -> str | None:
    """What a value logged with ``reduce_fx`` max, min or sum computes on a plan that cuts
    each batch into ``micro_batches`` x ``replicas`` slices, or None for the row-weighted
    mean (exact for a per-row value and for a batch mean alike). The strategy cannot tell a
    per-row value (a count, an error's max: exact) from a batch mean (a loss: the sum or
    max of the slices' means), so it says so once per name."""
    how = combination(kwargs)
    if how == "mean" or micro_batches * replicas == 1:
        return None
    slices = f"{micro_batches} micro-batch slices" + (f" on each of {replicas} replicas" if replicas > 1 else "")
    return (
        f"self.log('{name}', ..., reduce_fx='{how}'): each batch runs as {slices}, and the step's value is the {how} of "
        f"the slices' values. That is the batch's {how} for a value over rows (a count, an error's max), but for a batch "
        f"mean (a loss, an accuracy) it is the {how} of the slices' means, not plain Lightning's value. Log batch means "
        "with reduce_fx='mean' (the default: the slices' row-weighted mean, exactly the batch's mean), and aggregate them "
        "over the epoch yourself where you need their sum or max"
    )


def combine_logged(
    a: tuple["torch.Tensor | float", float], b: tuple["torch.Tensor | float", float], kwargs: dict[str, Any]
) -> tuple["torch.Tensor | float", float]:
    """Two (weighted sum, weight) parts of one logged value, combined (``combination``)."""
    how = combination(kwargs)
    if how in ("mean", "sum"):
        return a[0] + b[0], (a[1] + b[1] if how == "mean" else 1.0)
    if not isinstance(a[0], torch.Tensor) and not isinstance(b[0], torch.Tensor):
        return (max if how == "max" else min)(a[0], b[0]), 1.0
    home = a[0].device if isinstance(a[0], torch.Tensor) else b[0].device  # type: ignore[union-attr]
    left, right = torch.as_tensor(a[0], dtype=torch.float64, device=home), torch.as_tensor(b[0], dtype=torch.float64, device=home)
    return (torch.maximum if how == "max" else torch.minimum)(left, right), 1.0


@dataclass
class LogRecorder:
    """Collects ``self.log`` calls made on the last stage during one step.

    A logged tensor is weighted and summed where it lives, per micro-batch, in float64 (the
    same arithmetic as on the host, so the numbers are identical); the host reads the sums
    once per step, and only when they travel to other ranks (``summary(on_host=True)``).
    """

    values: dict[str, LoggedValue] = field(default_factory=dict)
    weight: float = 1.0
    module: nn.Module | None = None

    @contextlib.contextmanager
    def recording(self, module: nn.Module, weight: float) -> Iterator[None]:
        self.weight = weight
        self.module = module
        original = module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise DappleConfigError("self.log", "got positional options", "pass log options as keywords")
            self.add(name, value, kwargs)

        module.log = log  # type: ignore[method-assign]
        original_dict = module.log_dict

        def log_dict(dictionary: dict[str, Any], **kwargs: Any) -> None:
            for key, value in dictionary.items():
                self.add(key, value, kwargs)

        module.log_dict = log_dict  # type: ignore[method-assign]
        try:
            yield
        finally:
            module.log = original  # type: ignore[method-assign]
            module.log_dict = original_dict  # type: ignore[method-assign]

    def add(self, name: str, value: Any, kwargs: dict[str, Any]) -> None:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("batch_size", "sync_dist", "rank_zero_only")}
        if isinstance(value, Metric):
            kwargs["metric_attribute"] = kwargs.get("metric_attribute") or self._metric_path(name, value)
            value = getattr(value, "_forward_cache", None)  # its value on this slice; None after update() alone
        if value is None:
            self.values.setdefault(name, LoggedValue(0.0, 0.0, kwargs))
            return
        number = value.detach().to(torch.float64).mean() if isinstance(value, torch.Tensor) else float(value)
        entry = self.values.get(name)
        mean = combination(kwargs) == "mean"
        part = (number * self.weight, self.weight) if mean else (number, 1.0)
        if entry is None:
            self.values[name] = LoggedValue(part[0], part[1], kwargs)
        else:
            entry.weighted_sum, entry.weight = combine_logged((entry.weighted_sum, entry.weight), part, kwargs)

    def _metric_path(self, name: str, metric: Metric) -> str:
        """Where ``metric`` lives in the module: every rank logs its own copy from there.
        The module's metric paths are found once (the step logs them per micro-batch), and
        again only for a metric added since."""
        assert self.module is not None
        paths = _METRIC_PATHS.get(self.module)
        if paths is None or id(metric) not in paths or self.module.get_submodule(paths[id(metric)]) is not metric:
            paths = {id(sub): path for path, sub in self.module.named_modules() if isinstance(sub, Metric)}
            _METRIC_PATHS[self.module] = paths
        if id(metric) in paths:
            return paths[id(metric)]
        raise DappleConfigError(
            f"self.log('{name}', metric)",
            "logs a torchmetrics Metric that is not a submodule of the LightningModule, so the other ranks cannot log their copy of it",
            "assign the metric to an attribute in __init__ (self.val_f1 = F1Score(...)), or keep it in an nn.ModuleDict or a MetricCollection",
        )

    def summary(self, on_host: bool = False) -> Logs | None:
        """What was logged, or None when nothing was (then nothing needs to travel). With
        ``on_host`` the sums are floats, read from the device in one transfer."""
        if not self.values:
            return None
        sums = [v.weighted_sum for v in self.values.values()]
        if on_host:
            sums = _to_floats(sums)
        return {name: (total, v.weight, v.kwargs) for (name, v), total in zip(self.values.items(), sums)}


def _to_floats(values: list[torch.Tensor | float]) -> list[float]:
    """Floats of scalar tensors and numbers, with one device-to-host read for all tensors."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]  # type: ignore[arg-type]
    home = tensors[0].device
    read = iter(torch.stack([t.to(home) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def replay_logs(module: nn.Module, logs: Logs, batch_size: int, dtype: torch.dtype) -> None:
    """Log the combined values on this rank, weighted per step by the global batch size
    (a value still on the device is logged from there, without a host read).

    A torchmetrics Metric is logged as the rank's own copy of it (``metric_attribute``), as
    Lightning logs it: its step value is the slices' weighted mean, its epoch value
    Lightning's ``compute()``, which adds up the states of every rank. The last stage's
    ranks updated theirs with the rows they hold; the other ranks' copies stay empty and add
    nothing, so the epoch value is that of one device over the whole data."""
    log_dtype = dtype if dtype.is_floating_point else torch.float32
    for name, (weighted_sum, weight, kwargs) in logs.items():
        if isinstance(weighted_sum, torch.Tensor):
            value = weighted_sum / weight if weight else torch.zeros_like(weighted_sum)
        else:
            value = torch.tensor(weighted_sum / weight if weight else 0.0, dtype=torch.float64)
        path = kwargs.get("metric_attribute")
        if path is None:
            module.log(name, value.to(log_dtype), batch_size=batch_size, **kwargs)
            continue
        metric = module.get_submodule(path)
        metric._forward_cache = value.to(log_dtype) if weight else None  # what Lightning logs on the step
        metric._update_count = max(metric._update_count, 1)  # updated for this step, if not on this rank
        module.log(name, metric, **kwargs)