"""Per-layer profile of a model: the only thing the planner and simulator know about it.

The quantities are those of DAPPLE 4.1 (forward/backward time per stage, parameter sizes
for the AllReduce term, activation sizes for cross-stage communication) and PipeDream 3.1
(per-layer compute time, output activation size, weight size). ``backward_input_ms`` and
``backward_weight_ms`` split the backward for out-of-order backprop (ooo-backprop sec. 3).
``stash_bytes`` is what a layer keeps from its forward until its backward; the memory
model multiplies it by the number of micro-batches in flight (DAPPLE 5.3, K_i).
``output_whole_bytes`` is the part of a cut that is the same for every sample (a rotary
table, a broadcast mask: ``sample_rows``), sent whole once per micro-batch and receiver;
``cut_bytes`` is the one place that adds it to the per-sample part.
``stash_whole_bytes`` is the part of the stash that is whole in the same sense (a saved
rotary table or mask: one copy per micro-batch slice, whatever its rows); ``stash_span_bytes``
is the one place that prices a span of layers' stash for a slice.
``tied`` lists parameters several layers use (tied weights): a layer's ``param_bytes``
counts a parameter only in the first layer using it, and the cost model adds the copy
every other stage holding one of its layers keeps (``plan/costs.py``).

Times are for one micro-batch of ``micro_batch_size`` samples on one device; a device that
runs a slice of ``n`` samples is charged ``n / micro_batch_size`` of them (linear scaling).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.action_overhead import NO_OVERHEAD, ActionOverhead, overhead_from_dict
from lightning_dapple.profile.step_glue import NO_GLUE, StepGlue, glue_from_dict


def cut_bytes(per_sample: Any, whole: Any, scale: Any) -> Any:
    """Bytes crossing a cut for ``scale`` x the profile's micro-batch: the per-sample part
    scaled, the whole part once. The one formula for a cut's bytes (floats or numpy
    arrays alike: the planner's tables price every cut at once with it)."""
    return per_sample * scale + whole


def stash_span_bytes(layers: "Sequence[LayerProfile]", scale: float) -> float:
    """What ``layers`` stash for one slice of ``scale`` x the profile's micro-batch (DAPPLE
    5.3: the bytes one micro-batch in flight keeps): the per-sample stash scaled, the whole
    stash once. The one formula every consumer of a stage's stash uses (the search tables
    sum the same two parts in the same order)."""
    return span_stash_per_sample(layers) * scale + span_stash_whole(layers)


def span_stash_per_sample(layers: "Sequence[LayerProfile]") -> float:
    """The per-sample stash of ``layers`` on one stage: each layer's, less what it shares
    with the layer before it in the span (``stash_shared_bytes``: the previous layer's
    output, saved by both, is stashed once). The first layer's share is with a layer on
    another stage, so it counts whole."""
    return sum(layer.stash_bytes - (layer.stash_shared_bytes if index else 0.0) for index, layer in enumerate(layers))


def span_stash_whole(layers: "Sequence[LayerProfile]") -> float:
    """The whole stash of ``layers`` on one stage, by the same rule: a whole value the layer
    before also saves (a rotary table passed from layer to layer, ``stash_shared_whole_bytes``)
    is stashed once."""
    return sum(layer.stash_whole_bytes - (layer.stash_shared_whole_bytes if index else 0.0) for index, layer in enumerate(layers))


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer for one micro-batch of the profile's size.

    ``output_bytes`` is what crosses a cut placed right after this layer (for a linearised
    branching graph, every activation produced at or before this position and consumed
    after it), the per-sample part: it scales with the rows. ``output_whole_bytes`` is
    the part that does not (values with no batch dimension or a first dimension of 1);
    profiles without it have none. ``stash_bytes`` / ``stash_whole_bytes`` split what the
    layer saves for backward the same way; ``stash_shared_bytes`` is the part of the
    per-sample stash that the layer before also saves (its output, this layer's input),
    stashed once when both are on one stage; ``stash_shared_whole_bytes`` is the same for the
    whole stash (a table each layer saves and passes on). ``optimizer_ms`` is one optimizer step over the
    layer's parameters (the run's own optimizer, ``profile/optimizer_step.py``): it does not
    scale with the rows, and every replica of a stage pays it once per step; profiles
    without it have none. ``accumulate_ms`` is one in-place add of the layer's parameter
    gradients into gradients already there (autograd's AccumulateGrad): what every backward
    of a step after its first micro-batch pays beside ``backward_ms``, which the profiler
    times without accumulating; it does not scale with the rows; profiles without it have none.
    """

    name: str
    forward_ms: float
    backward_ms: float
    output_bytes: float
    param_bytes: float
    stash_bytes: float
    backward_input_ms: float | None = None
    backward_weight_ms: float | None = None
    output_whole_bytes: float = 0.0
    stash_whole_bytes: float = 0.0
    optimizer_ms: float = 0.0
    stash_shared_bytes: float = 0.0
    stash_shared_whole_bytes: float = 0.0
    accumulate_ms: float = 0.0

    def stash_for(self, scale: float) -> float:
        """Bytes this layer stashes for one slice of ``scale`` x the profile's micro-batch."""
        return stash_span_bytes((self,), scale)

    def cut_bytes(self, scale: float) -> float:
        """Bytes crossing a cut after this layer for ``scale`` x the profile's micro-batch."""
        return cut_bytes(self.output_bytes, self.output_whole_bytes, scale)

    @property
    def input_grad_ms(self) -> float:
        """Time of the input-gradient half of backward (B); all of it when not split."""
        return self.backward_ms if self.backward_input_ms is None else self.backward_input_ms

    @property
    def weight_grad_ms(self) -> float:
        """Time of the weight-gradient half of backward (W); 0 when not split."""
        if self.backward_input_ms is None:
            return 0.0
        if self.backward_weight_ms is not None:
            return self.backward_weight_ms
        return max(self.backward_ms - self.backward_input_ms, 0.0)


@dataclass(frozen=True)
class TiedParams:
    """Parameter bytes that several layers use (tied weights, e.g. a token embedding whose
    matrix is also the output projection).

    ``param_bytes`` is counted in the ``param_bytes`` of the first of ``layers`` only, so
    the layers' sum stays the model's size. A plan whose stages split ``layers`` keeps a
    copy on every stage holding one of them, and sums the copies' gradients with one
    AllReduce over all their devices instead of in the stages' own buckets.
    """

    layers: tuple[int, ...]
    param_bytes: float
    names: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "param_bytes": self.param_bytes, "names": list(self.names)}


@dataclass(frozen=True)
class ModelProfile:
    """A model as a chain of layers plus the size of the batch the times were taken at.

    ``input_bytes`` is the size of the model input for one micro-batch (what the first
    stage receives from the data loader); it is not communicated between devices.
    ``input_whole_bytes`` is its part that is not per-sample (``sample_rows``): every slice
    of the first stage holds it once. ``action_overhead_ms`` is the executor's own time per
    action on the machine the profile was taken on (``profile/action_overhead.py``), and
    ``step_glue_ms`` the user's step around the layers per micro-batch (``profile/step_glue.py``);
    none in a profile that does not say.
    """

    micro_batch_size: int
    layers: tuple[LayerProfile, ...]
    device: str = "unknown"
    name: str = "model"
    input_bytes: float = 0.0
    input_whole_bytes: float = 0.0
    estimated: bool = False
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    tied: tuple[TiedParams, ...] = ()
    action_overhead_ms: ActionOverhead = NO_OVERHEAD
    step_glue_ms: StepGlue = NO_GLUE

    def __post_init__(self) -> None:
        validate_profile(self)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def scale(self, samples: float) -> float:
        """Factor that turns a profile-size quantity into one for ``samples`` samples."""
        return samples / self.micro_batch_size

    def input_slice_bytes(self, scale: float) -> float:
        """Bytes of the model input for one slice of ``scale`` x the micro-batch."""
        return cut_bytes(self.input_bytes, self.input_whole_bytes, scale)

    def span(self, start: int, end: int) -> tuple[LayerProfile, ...]:
        """Layers ``[start, end)``."""
        return self.layers[start:end]

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            entry = asdict(layer)
            for optional in ("backward_input_ms", "backward_weight_ms"):
                if entry[optional] is None:
                    del entry[optional]
            for optional in ("output_whole_bytes", "stash_whole_bytes", "optimizer_ms", "stash_shared_bytes", "stash_shared_whole_bytes", "accumulate_ms"):
                if not entry[optional]:
                    del entry[optional]
            layers.append(entry)
        out: dict[str, Any] = {
            "name": self.name,
            "micro_batch_size": self.micro_batch_size,
            "device": self.device,
            "input_bytes": self.input_bytes,
            "layers": layers,
        }
        if self.input_whole_bytes:
            out["input_whole_bytes"] = self.input_whole_bytes
        if self.estimated:
            out["estimated"] = True
        if self.tied:
            out["tied"] = [tie.to_dict() for tie in self.tied]
        if not self.action_overhead_ms.is_zero:
            out["action_overhead_ms"] = self.action_overhead_ms.to_dict()
        if not self.step_glue_ms.is_zero:
            out["step_glue_ms"] = self.step_glue_ms.to_dict()
        if self.meta:
            out["meta"] = self.meta
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


_REQUIRED_LAYER_FIELDS = ("name", "forward_ms", "backward_ms", "output_bytes", "param_bytes", "stash_bytes")


def _number(value: Any, where: str, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DappleConfigError(where, f"expected a finite number, got {value!r}", fix)
    return float(value)


def validate_profile(profile: ModelProfile) -> None:
    """Reject profiles the planner cannot reason about, naming the field and the fix."""
    require(
        isinstance(profile.micro_batch_size, int) and profile.micro_batch_size > 0,
        "profile.micro_batch_size",
        f"must be a positive integer, got {profile.micro_batch_size!r}",
        "set it to the number of samples the layer times were measured with",
    )
    require(len(profile.layers) > 0, "profile.layers", "is empty", "list at least one layer")
    for name in ("input_bytes", "input_whole_bytes"):
        value = _number(getattr(profile, name), f"profile.{name}", "write a number >= 0")
        require(value >= 0, f"profile.{name}", f"is negative ({value})", "sizes must be >= 0")
    for index, layer in enumerate(profile.layers):
        where = f"profile.layers[{index}] ({layer.name})"
        for name in ("forward_ms", "backward_ms", "output_bytes", "param_bytes", "stash_bytes", "output_whole_bytes", "stash_whole_bytes", "optimizer_ms", "stash_shared_bytes", "stash_shared_whole_bytes", "accumulate_ms"):
            value = _number(getattr(layer, name), f"{where}.{name}", "write a number >= 0")
            require(value >= 0, f"{where}.{name}", f"is negative ({value})", "times and sizes must be >= 0")
        require(
            layer.stash_shared_bytes <= layer.stash_bytes,
            f"{where}.stash_shared_bytes",
            f"is {layer.stash_shared_bytes}, more than the layer's stash_bytes ({layer.stash_bytes})",
            "give the part of stash_bytes the previous layer also saves (at most stash_bytes), or leave it out",
        )
        require(
            layer.stash_shared_whole_bytes <= layer.stash_whole_bytes,
            f"{where}.stash_shared_whole_bytes",
            f"is {layer.stash_shared_whole_bytes}, more than the layer's stash_whole_bytes ({layer.stash_whole_bytes})",
            "give the part of stash_whole_bytes the previous layer also saves (at most stash_whole_bytes), or leave it out",
        )
        for name in ("backward_input_ms", "backward_weight_ms"):
            value = getattr(layer, name)
            if value is not None:
                value = _number(value, f"{where}.{name}", "write a number >= 0 or leave it out")
                require(value >= 0, f"{where}.{name}", f"is negative ({value})", "times must be >= 0")
    for index, tie in enumerate(profile.tied):
        _validate_tie(tie, f"profile.tied[{index}]", len(profile.layers))


def _validate_tie(tie: TiedParams, where: str, num_layers: int) -> None:
    layers = tie.layers
    require(
        len(layers) >= 2 and list(layers) == sorted(set(layers)),
        f"{where}.layers",
        f"is {list(layers)}",
        "list the indices of at least two layers that use the parameter, ascending, each once",
    )
    require(
        all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers),
        f"{where}.layers",
        f"names a layer outside 0..{num_layers - 1}: {list(layers)}",
        "use indices of the profile's layers",
    )
    value = _number(tie.param_bytes, f"{where}.param_bytes", "write a number >= 0")
    require(value >= 0, f"{where}.param_bytes", f"is negative ({value})", "sizes must be >= 0")


def profile_from_dict(data: Any, source: str = "profile") -> ModelProfile:
    """Build a profile from the JSON form documented in docs/formats.md."""
    require(isinstance(data, dict), source, "is not a JSON object", "see docs/formats.md for the profile format")
    require("micro_batch_size" in data, f"{source}.micro_batch_size", "is missing", "add the profile batch size")
    require("layers" in data, f"{source}.layers", "is missing", "add the list of per-layer entries")
    require(isinstance(data["layers"], list), f"{source}.layers", "is not a list", "make it a list of layer objects")
    layers = []
    for index, entry in enumerate(data["layers"]):
        where = f"{source}.layers[{index}]"
        require(isinstance(entry, dict), where, "is not an object", "write each layer as a JSON object")
        for name in _REQUIRED_LAYER_FIELDS:
            require(name in entry, f"{where}.{name}", "is missing", f"add '{name}' to every layer (see docs/formats.md)")
        numbers = {
            name: _number(entry[name], f"{where}.{name}", "write a number >= 0")
            for name in _REQUIRED_LAYER_FIELDS[1:]
        }
        optional = {
            name: (None if entry.get(name) is None else _number(entry[name], f"{where}.{name}", "write a number >= 0"))
            for name in ("backward_input_ms", "backward_weight_ms")
        }
        whole = {
            name: _number(entry.get(name, 0.0), f"{where}.{name}", "write a number >= 0 or leave it out")
            for name in ("output_whole_bytes", "stash_whole_bytes", "optimizer_ms", "stash_shared_bytes", "stash_shared_whole_bytes", "accumulate_ms")
        }
        layers.append(LayerProfile(name=str(entry["name"]), **numbers, **optional, **whole))
    mbs = data["micro_batch_size"]
    require(
        isinstance(mbs, int) and not isinstance(mbs, bool) and mbs > 0,
        f"{source}.micro_batch_size",
        f"must be a positive integer, got {mbs!r}",
        "set it to the number of samples the layer times were measured with",
    )
    return ModelProfile(
        micro_batch_size=mbs,
        layers=tuple(layers),
        device=str(data.get("device", "unknown")),
        name=str(data.get("name", "model")),
        input_bytes=_number(data.get("input_bytes", 0.0), f"{source}.input_bytes", "write a number >= 0"),
        input_whole_bytes=_number(data.get("input_whole_bytes", 0.0), f"{source}.input_whole_bytes", "write a number >= 0 or leave it out"),
        estimated=bool(data.get("estimated", False)),
        meta=dict(data.get("meta", {})),
        tied=_ties_from_list(data.get("tied", []), f"{source}.tied"),
        action_overhead_ms=overhead_from_dict(data.get("action_overhead_ms", {}), f"{source}.action_overhead_ms"),
        step_glue_ms=glue_from_dict(data.get("step_glue_ms", {}), f"{source}.step_glue_ms"),
    )


def _ties_from_list(entries: Any, source: str) -> tuple[TiedParams, ...]:
    """The optional ``tied`` list (profiles written before it existed have none)."""
    require(isinstance(entries, list), source, "is not a list", "make it a list of {layers, param_bytes} objects or leave it out")
    ties = []
    for index, entry in enumerate(entries):
        where = f"{source}[{index}]"
        require(isinstance(entry, dict) and "layers" in entry and "param_bytes" in entry, where, "needs 'layers' and 'param_bytes'", "see docs/formats.md")
        require(isinstance(entry["layers"], list), f"{where}.layers", "is not a list", "list the layer indices")
        names = entry.get("names", [])
        ties.append(TiedParams(tuple(entry["layers"]), _number(entry["param_bytes"], f"{where}.param_bytes", "write a number >= 0"), tuple(str(n) for n in names)))
    return tuple(ties)
