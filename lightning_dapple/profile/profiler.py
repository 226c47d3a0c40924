"""Measure a per-layer profile of a model by running each layer on its own.

DAPPLE's planner (DAPPLE 4.1) needs, per layer and per micro-batch, the forward and
backward time, the parameter bytes (AllReduce volume), the bytes of the output (what a
cut after the layer sends to the next stage) and what the layer keeps for its backward
(the activation memory that grows with the number of micro-batches in flight, DAPPLE 5.3).
PipeDream's profiler (PipeDream 3.2, "Profiling the DNN Model") gets these by timing each layer on one device for a
few iterations; we do the same, layer by layer, so a model that does not fit on the
device can still be profiled (each layer is moved to ``device`` and back).

The backward is also split into its input-gradient half (B: gradient w.r.t. the layer's
input, which the previous stage is waiting for) and its weight-gradient half (W: gradient
w.r.t. the parameters, which can be deferred), as out-of-order backprop (ooo-backprop 3)
schedules them separately (its dO_i and dW_i). B is ``autograd.grad`` w.r.t. the floating inputs with
``retain_graph=True``; W is a second ``autograd.grad`` w.r.t. the parameters. For a
composite layer W re-traverses the layer's internal graph, so B + W can exceed the full
backward; the full backward is measured separately and reported as ``backward_ms``.

Calling convention (the same as the runtime's): a layer is called as ``layer(x)`` where
``x`` is exactly what the previous layer returned -- a tensor, a tuple/list or a dict --
passed as ONE positional argument and never unpacked. The first layer gets the sample
input the same way.

Measured quantities, per layer:

* ``forward_ms``: forward with autograd recording (as in training);
* ``backward_ms``: gradient w.r.t. the floating inputs and the parameters together;
* ``backward_input_ms`` / ``backward_weight_ms``: the B / W split above;
* ``output_bytes`` / ``output_whole_bytes``: every tensor in the output, whether or not it
  requires grad, split by ``sample_rows.is_whole`` against the sample's rows into the
  per-sample part and the part sent whole (a (1, T, n) table beside the batch). A sample of
  one row cannot tell the two apart: all of it counts as per-sample then;
* ``param_bytes``: the layer's parameters; a parameter several layers use (tied
  weights) counts in the first of them only, and the profile's ``tied`` says which
  layers share it (``profile/ties.py``);
* ``stash_bytes`` / ``stash_whole_bytes``: distinct storages saved for backward during the
  forward (observed with ``torch.autograd.graph.saved_tensors_hooks``), the layer's own
  parameters excluded, split like the output into the per-sample part and the whole part (a
  saved tensor whole by ``sample_rows``, or a view of a whole input: ``profile/stash.py``).
  A tensor two consecutive layers save (one's output, the next one's input) is counted in
  both, and the second layer's ``stash_shared_bytes`` say how much of its stash it is, so
  a stage holding both counts it once (``model_profile.stash_span_bytes``);
  ``stash_shared_whole_bytes`` do the same for a whole value each layer saves and passes on
  (a rotary table);
* the model's ``input_bytes`` / ``input_whole_bytes``: the sample input split the same way.

The cotangent fed to the backward is a fixed random tensor of the output's shape, so runs
are comparable. Layers are profiled in their current train/eval mode; buffers (e.g.
BatchNorm running statistics) and the global RNG state are restored afterwards.
"""
from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.grad_accumulation import measure_accumulate_ms
from lightning_dapple.profile.inplace import writes_input_in_place
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile, profile_from_dict
from lightning_dapple.profile.sample_rows import batch_rows, is_whole, split_bytes
from lightning_dapple.profile.timing import timed_ms
from lightning_dapple.profile.stash import StashMeter, parameter_storages, shared_views, whole_input_storages
from lightning_dapple.profile.ties import first_use_param_bytes, tied_params_records, tied_parameters

__all__ = ["forked_rng", "model_key", "profile_layers", "run_layers_once", "tensor_bytes", "iter_tensors", "map_tensors", "timed_ms", "visiting"]

_CACHE_VERSION = 6  # 3: stash and input split into per-sample and whole parts; 4: stash_shared_bytes; 5: stash_shared_whole_bytes; 6: accumulate_ms
_CONVENTION_FIX = (
    "each layer is called as layer(x) with x exactly what the previous layer returned "
    "(one positional argument: a tensor, tuple or dict, never unpacked); make the layers accept that"
)


# --------------------------------------------------------------------------- tensor trees


def iter_tensors(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor in a nested tensor / tuple / list / dict value, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by ``fn(tensor)``, containers rebuilt alike."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        items = [(key, map_tensors(item, fn)) for key, item in value.items()]
        return type(value)(items) if isinstance(value, dict) else dict(items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(item, fn) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, fn) for item in value)
    return value


def tensor_bytes(value: Any) -> int:
    """Bytes of the distinct tensors in a nested value (a tensor listed twice counts once)."""
    seen: set[int] = set()
    total = 0
    for tensor in iter_tensors(value):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _describe(value: Any) -> Any:
    """Structure, shapes and dtypes of a sample input, for the cache key."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, Mapping):
        return ["dict", [[str(key), _describe(item)] for key, item in value.items()]]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_describe(item) for item in value]]
    return [type(value).__name__, repr(value)]


# --------------------------------------------------------------------------- helpers


def _as_layer_list(layers: Any) -> list[nn.Module]:
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
        raise DappleConfigError(
            "layers",
            f"is a single {type(layers).__name__}, not a sequence of layers",
            "pass an nn.Sequential, an nn.ModuleList or a list of modules",
        )
    try:
        result = list(layers)
    except TypeError:
        raise DappleConfigError(
            "layers", f"is a {type(layers).__name__}, not a sequence of layers", "pass an nn.Sequential, an nn.ModuleList or a list of modules"
        ) from None
    require(bool(result), "layers", "is empty", "pass at least one layer")
    for index, layer in enumerate(result):
        require(
            isinstance(layer, nn.Module),
            f"layers[{index}]",
            f"is a {type(layer).__name__}, not an nn.Module",
            "make every layer an nn.Module",
        )
    return result


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DappleConfigError("device", f"{device!r} is not a device", "use e.g. 'cpu' or 'cuda:0'") from None
    if dev.type == "cuda":
        require(torch.cuda.is_available(), "device", f"{device!r} asked for but CUDA is not available", "use --device cpu")
    return dev


def forked_rng(device: torch.device) -> Any:
    """``torch.random.fork_rng`` over the CPU's and ``device``'s generators: what runs inside
    leaves the training's random stream as it was."""
    return torch.random.fork_rng(devices=[device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else [])


@contextmanager
def visiting(layer: nn.Module, device: torch.device) -> Iterator[None]:
    """``layer`` on ``device`` for the block, then back where it was with its buffers as they
    were (running statistics are not the profiler's to change): one layer on the device at a
    time, so a model larger than the device can be run through."""
    home = _layer_home(layer)
    buffers = {key: b.detach().clone() for key, b in layer.named_buffers()}
    layer.to(device)
    try:
        yield
    finally:
        if home is not None:
            layer.to(home)
        with torch.no_grad():
            for key, b in layer.named_buffers():
                if key in buffers:
                    b.copy_(buffers[key])


def _layer_home(layer: nn.Module) -> torch.device | None:
    for tensor in layer.parameters():
        return tensor.device
    for tensor in layer.buffers():
        return tensor.device
    return None


def _call(layer: nn.Module, index: int, x: Any, autocast: torch.dtype | None = None) -> Any:
    try:
        if autocast is None:
            return layer(x)
        device = next((t.device.type for t in iter_tensors(x)), "cpu")
        with torch.autocast(device, dtype=autocast):
            return layer(x)
    except Exception as exc:  # a convention mismatch or a shape bug: say which layer
        raise DappleConfigError(
            f"layers[{index}] ({type(layer).__name__})",
            f"forward failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            _CONVENTION_FIX,
        ) from exc


def model_key(layers: Sequence[nn.Module], sample_input: Any, device: str | torch.device, autocast_dtype: torch.dtype | None = None) -> str:
    """A hash of what makes two runs' models alike to the profiler: the layers' reprs,
    parameter and buffer shapes and ties, the input's structure and rows, the device and the
    autocast dtype (the profile cache's key without its repetition counts). Measured choices
    kept beside the profile (``strategy/plan_tuning.py``) are filed under it."""
    layer_list = list(layers)
    rows = _check_inputs(sample_input, 1, 0)
    return _cache_key(layer_list, sample_input, _device(device), rows, 0, 0, autocast_dtype)


def _cache_key(
    layers: list[nn.Module], sample_input: Any, device: torch.device, batch: int, repeats: int, warmup: int, autocast: torch.dtype | None = None
) -> str:
    ties = [tie.uses for tie in tied_parameters(layers)]
    description = {
        "version": _CACHE_VERSION,
        "layers": [
            {
                "repr": repr(layer),
                "params": [[name, list(p.shape), str(p.dtype), bool(p.requires_grad)] for name, p in layer.named_parameters()],
                "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in layer.named_buffers()],
            }
            for layer in layers
        ],
        "input": _describe(sample_input),
        "device": str(device),
        "samples": batch,
        "repeats": repeats,
        "warmup": warmup,
        **({"autocast": str(autocast)} if autocast is not None else {}),
        **({"tied": ties} if ties else {}),  # untied models keep their cache keys
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- measurement


def _no_second_backward(exc: RuntimeError) -> bool:
    """Whether a backward refused to keep its graph for a second one: a ``torch.compile``d
    layer whose compiled backward donates its buffers (AOTAutograd) runs once per forward,
    so B and W cannot be timed apart; the layer's whole backward is its B."""
    text = str(exc)
    return "retain_graph" in text or "donated buffer" in text


def _leaf_input(x: Any, copy_input: bool) -> tuple[Any, list[torch.Tensor]]:
    """``x`` with its floating tensors made leaves that require grad (a stage input), and
    those leaves; a layer writing its input in place gets copies of them."""
    leaves: list[torch.Tensor] = []

    def make_leaf(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            leaf = tensor.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone() if copy_input else leaf
        return tensor

    return map_tensors(x, make_leaf), leaves


@dataclass(frozen=True)
class StashViews:
    """The views one layer saves of its inputs and of its outputs, by position
    (``StashMeter.views_of``), per-sample and whole apart. A layer given a copy of its input
    (one that writes it in place, ``profile/inplace.py``) saves none of the input the layer
    before produced."""

    inputs: dict[tuple, int]
    outputs: dict[tuple, int]
    whole_inputs: dict[tuple, int]
    whole_outputs: dict[tuple, int]

    @classmethod
    def of(cls, meter: StashMeter, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> "StashViews":
        return cls(meter.views_of(inputs), meter.views_of(outputs), meter.views_of(inputs, whole=True), meter.views_of(outputs, whole=True))


def _measure_layer(
    layer: nn.Module, index: int, label: str, x: Any, device: torch.device, repeats: int, warmup: int, autocast: torch.dtype | None = None, *, rows: int
) -> tuple[LayerProfile, Any, "StashViews"]:
    """Profile one layer (already on ``device``) on input ``x`` (already on ``device``) of
    ``rows`` samples; its forwards run under autocast to ``autocast`` when given (mixed
    precision). Also returns the next layer's input and the views the layer saves of its
    input and its output (``StashViews``)."""
    params = [p for p in layer.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    param_storages_ptrs = parameter_storages(list(layer.parameters()))

    copy_input = writes_input_in_place(layer)  # as the executor gives such a layer a copy

    def grad_input() -> tuple[Any, list[torch.Tensor]]:
        return _leaf_input(x, copy_input)

    # Stash: tensors saved for backward during one forward, the layer's parameters
    # excluded, by the rule the executor uses too (profile/stash.py).
    whole_inputs = whole_input_storages([t for t in iter_tensors(x) if is_whole(t.shape, rows)], param_storages_ptrs)
    meter = StashMeter(param_storages_ptrs, rows=rows, whole_inputs=whole_inputs)
    xg, _ = grad_input()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = _call(layer, index, xg, autocast)
    views = StashViews.of(meter, [] if copy_input else list(iter_tensors(xg)), list(iter_tensors(out)))
    output_bytes, output_whole_bytes = split_bytes(iter_tensors(out), rows)
    differentiable = [t for t in iter_tensors(out) if t.requires_grad]
    generator = torch.Generator(device="cpu").manual_seed(1234 + index)
    cotangents = [
        torch.randn(t.shape, generator=generator, dtype=torch.float32).to(device=t.device, dtype=t.dtype) for t in differentiable
    ]
    del out, xg, differentiable

    forward, backward, backward_in, backward_w = [], [], [], []
    for step in range(warmup + repeats):
        xg, leaves = grad_input()
        with torch.enable_grad():
            fwd_ms, out = timed_ms(device, lambda: _call(layer, index, xg, autocast))
        outs = [t for t in iter_tensors(out) if t.requires_grad]
        full_ms = b_ms = w_ms = 0.0
        targets = leaves + params
        if outs and targets:
            full_ms, _ = timed_ms(device, lambda: torch.autograd.grad(outs, targets, cotangents, allow_unused=True))
            del out, outs
            xg, leaves = grad_input()
            with torch.enable_grad():
                out = _call(layer, index, xg, autocast)
            outs = [t for t in iter_tensors(out) if t.requires_grad]
            try:
                if leaves:
                    b_ms, _ = timed_ms(
                        device, lambda: torch.autograd.grad(outs, leaves, cotangents, retain_graph=bool(params), allow_unused=True)
                    )
                if params:
                    w_ms, _ = timed_ms(device, lambda: torch.autograd.grad(outs, params, cotangents, allow_unused=True))
            except RuntimeError as exc:
                if not _no_second_backward(exc):
                    raise
                b_ms, w_ms = full_ms, 0.0  # a compiled layer's backward runs once: B does all of it
        del out, outs, xg, leaves
        if step >= warmup:
            forward.append(fwd_ms)
            backward.append(full_ms)
            backward_in.append(b_ms)
            backward_w.append(w_ms)

    with torch.no_grad():
        next_input = map_tensors(_call(layer, index, x, autocast), lambda t: t.detach())
    profile = LayerProfile(
        name=label,
        forward_ms=statistics.median(forward),
        backward_ms=statistics.median(backward),
        output_bytes=float(output_bytes),
        param_bytes=float(param_bytes),
        stash_bytes=float(meter.per_sample_bytes),
        backward_input_ms=statistics.median(backward_in),
        backward_weight_ms=statistics.median(backward_w),
        output_whole_bytes=float(output_whole_bytes),
        stash_whole_bytes=float(meter.whole_bytes),
    )
    return profile, next_input, views


def profile_layers(
    layers: nn.Sequential | nn.ModuleList | list[nn.Module],
    sample_input: Any,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: str | Path | None = None,
    name: str = "model",
    autocast_dtype: torch.dtype | None = None,
) -> ModelProfile:
    """Time and size every layer on one micro-batch, as PipeDream's profiler does (PipeDream 3.2).

    ``sample_input`` is one micro-batch (a tensor, tuple/list or dict of tensors); its rows
    (``sample_rows.batch_rows``: the first dimension of its first tensor with more than one
    row) are the profile's ``micro_batch_size`` (DAPPLE 4 scales times linearly from it). Each layer is moved to ``device``, measured with ``warmup`` untimed
    runs and the median of ``repeats`` timed runs, and moved back. With ``cache_dir`` the
    result is stored as JSON keyed by a hash of the layers' reprs and parameter shapes,
    the input's structure, the device and the sample size; a later call with the same key
    returns the stored profile without running any layer. ``autocast_dtype`` (bfloat16 or
    float16) runs every forward under ``torch.autocast``, as mixed-precision training does.

    Only one layer is on ``device`` at a time (each goes back where it was before the
    next one moves), so a model larger than the device's memory can be profiled.
    """
    layer_list = _as_layer_list(layers)
    keys = [key for key, _ in layers.named_children()] if isinstance(layers, (nn.Sequential, nn.ModuleList)) else []
    if len(keys) != len(layer_list):
        keys = [str(index) for index in range(len(layer_list))]
    labels = [f"{key} ({type(layer).__name__})" for key, layer in zip(keys, layer_list)]
    dev = _device(device)
    batch = _check_inputs(sample_input, repeats, warmup)
    cache_file = None
    if cache_dir is not None:
        key = _cache_key(layer_list, sample_input, dev, batch, repeats, warmup, autocast_dtype)
        cache_file = Path(cache_dir) / f"profile-{key[:32]}.json"
        cached = _cached_profile(cache_file, name)
        if cached is not None:
            return cached
    results = _measure_layers(layer_list, labels, sample_input, dev, repeats, warmup, autocast_dtype, batch)
    owned = first_use_param_bytes(layer_list)  # a tied parameter counts in its first layer
    input_bytes, input_whole_bytes = split_bytes(iter_tensors(sample_input), batch)
    result = ModelProfile(
        micro_batch_size=batch,
        layers=tuple(replace(layer, param_bytes=size) for layer, size in zip(results, owned)),
        tied=tied_params_records(tied_parameters(layer_list)),
        device=str(dev),
        name=name,
        input_bytes=float(input_bytes),
        input_whole_bytes=float(input_whole_bytes),
        meta={
            "source": "lightning_dapple.profile.profiler",
            "repeats": repeats,
            "warmup": warmup,
            "calling_convention": "layer(x), x = previous layer's output as one argument",
            "stash_bytes": "storages saved for backward (saved_tensors_hooks), parameters excluded; the whole part in stash_whole_bytes",
            **({"autocast": str(autocast_dtype)} if autocast_dtype is not None else {}),
        },
    )
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".json.tmp")
        tmp.write_text(result.to_json())
        tmp.replace(cache_file)  # atomic: a reader sees the old entry or the whole new one
    return result


def run_layers_once(
    layers: nn.Sequential | nn.ModuleList | list[nn.Module], sample_input: Any, device: str | torch.device = "cpu", autocast_dtype: torch.dtype | None = None
) -> Any:
    """The layers' output for ``sample_input``, on ``device``: one forward without autograd,
    each layer moved to ``device`` and back in turn as ``profile_layers`` moves it (so a
    model larger than the device runs too), its buffers as they were and the RNG forked."""
    dev = _device(device)
    x = map_tensors(sample_input, lambda t: t.to(dev))
    with forked_rng(dev), torch.no_grad():
        for index, layer in enumerate(_as_layer_list(layers)):
            with visiting(layer, dev):
                x = _call(layer, index, x, autocast_dtype)
    return x


def _check_inputs(sample_input: Any, repeats: Any, warmup: Any) -> int:
    """The sample's batch size, after checking the arguments (``DappleConfigError``)."""
    require(isinstance(repeats, int) and repeats >= 1, "repeats", f"must be an integer >= 1, got {repeats!r}", "use e.g. 5")
    require(isinstance(warmup, int) and warmup >= 0, "warmup", f"must be an integer >= 0, got {warmup!r}", "use e.g. 2")
    tensors = list(iter_tensors(sample_input))
    require(bool(tensors), "sample_input", "contains no tensor", "pass one micro-batch: a tensor, or a tuple/dict of tensors")
    batch = batch_rows(tensors)
    require(
        batch is not None,
        "sample_input",
        "has only 0-dimensional tensors, so it has no batch dimension",
        "give the per-sample tensors a leading batch dimension",
    )
    assert batch is not None
    require(batch > 0, "sample_input", "has batch size 0", "pass at least one sample")
    return batch


def _cached_profile(cache_file: Path, name: str) -> ModelProfile | None:
    """The stored profile of the same layers, input and device, or None (a damaged entry
    counts as none: it is measured again and overwritten)."""
    if not cache_file.is_file():
        return None
    try:
        cached = profile_from_dict(json.loads(cache_file.read_text()), source=f"cache {cache_file.name}")
    except (DappleConfigError, json.JSONDecodeError, OSError):
        return None
    return replace(cached, name=name, meta={**cached.meta, "cache": "hit"})


def _measure_layers(
    layer_list: list[nn.Module],
    labels: list[str],
    sample_input: Any,
    dev: torch.device,
    repeats: int,
    warmup: int,
    autocast_dtype: torch.dtype | None,
    rows: int,
) -> list[LayerProfile]:
    """Each layer in turn on ``dev`` with the previous one's output, then back home with its
    buffers as they were (running statistics are not the profiler's to change); the RNG is
    forked so that profiling leaves the training's random stream alone. A layer's
    ``stash_shared_bytes`` are the views of its input it saves that the previous layer saves
    of its output (``stash.shared_views``), ``stash_shared_whole_bytes`` the same for whole
    values."""
    home_of_input = next(iter(iter_tensors(sample_input))).device
    results: list[LayerProfile] = []
    previous: StashViews | None = None
    accumulated: set[int] = set()  # parameters whose gradient add an earlier layer counts (tied weights)
    x = sample_input
    with forked_rng(dev):
        for index, layer in enumerate(layer_list):
            with visiting(layer, dev):
                x_dev = map_tensors(x, lambda t: t.to(dev))
                profile, out, views = _measure_layer(layer, index, labels[index], x_dev, dev, repeats, warmup, autocast_dtype, rows=rows)
                profile = replace(profile, accumulate_ms=measure_accumulate_ms(layer, dev, repeats, warmup, accumulated))
            shared = shared_views(previous.outputs, views.inputs) if previous is not None else 0
            shared_whole = shared_views(previous.whole_outputs, views.whole_inputs) if previous is not None else 0
            results.append(replace(profile, stash_shared_bytes=float(shared), stash_shared_whole_bytes=float(shared_whole)))
            previous = views
            x = map_tensors(out, lambda t: t.to(home_of_input))
            del out, x_dev
    return results
