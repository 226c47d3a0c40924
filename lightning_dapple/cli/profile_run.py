"""The work behind ``dapple-profile``: load the user's model, find its layers, time them.

Kept apart from ``cli/profile.py`` (the argument parser) because it needs torch, which
takes about a second to import: ``dapple-profile --help`` answers without it.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from rich.table import Table
from torch import nn

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.plan.console import make_console
from lightning_dapple.execute.overhead_probe import with_action_overhead
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.profile.profiler import iter_tensors, map_tensors, profile_layers
from lightning_dapple.profile.traced_layers import finds_layers_from_forward, traced_layers
from lightning_dapple.profile.trace import forward_signature
from lightning_dapple.strategy.module_adapter import positional_arguments
from lightning_dapple.strategy.optimizer_probe import with_run_optimizer

__all__ = ["layers_of", "load_model", "print_profile", "profile_model", "resolve_layers", "run", "sample_input_of"]


def load_model(spec: str) -> nn.Module:
    """Import ``module:attr`` and call it (or instantiate it) with no arguments."""
    require(
        ":" in spec and all(spec.split(":", 1)),
        "--model",
        f"{spec!r} is not of the form 'pkg.module:factory'",
        "write the module path, a colon, then the callable's name",
    )
    module_name, attr_path = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except (ImportError, SyntaxError) as exc:
        raise DappleConfigError("--model", f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})", "check the module path and that it is on PYTHONPATH") from None
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise DappleConfigError("--model", f"{module_name!r} has no attribute {attr_path!r}", "check the factory name after the colon")
        target = getattr(target, part)
    require(callable(target), "--model", f"{spec!r} is not callable", "point it at a function or class returning an nn.Module")
    try:
        model = target()
    except TypeError as exc:
        what = "class" if inspect.isclass(target) else "factory"
        raise DappleConfigError("--model", f"calling {what} {attr_path!r} with no arguments failed ({exc})", "use a factory that takes no arguments") from None
    require(
        isinstance(model, nn.Module),
        "--model",
        f"{spec!r} returned a {type(model).__name__}, not an nn.Module",
        "return an nn.Module or LightningModule",
    )
    return model


def resolve_layers(model: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` of ``model`` (e.g. ``encoder.blocks``)."""
    target: Any = model
    for part in path.split("."):
        if not part or not hasattr(target, part):
            raise DappleConfigError(
                "--layers",
                f"{type(model).__name__} has no attribute {path!r}",
                "name the attribute holding the nn.Sequential / nn.ModuleList of layers",
            )
        target = getattr(target, part)
    return target


def layers_of(model: nn.Module, path: str, say: Callable[[str], Any] = print) -> nn.Module:
    """The layer sequence at ``path``, or, for ``auto`` or a model without the default
    ``layers``, the layer list traced from its ``forward`` on ``example_input_array`` (at one
    and two samples; ``profile.traced_layers``), which is shown with ``say``."""
    if not finds_layers_from_forward(model, path):
        return resolve_layers(model, path)
    layers = traced_layers(model, [_positional(model, sample_input_of(model, rows)) for rows in (1, 2)])
    say("\n".join(layers.describe()))
    return layers


def _positional(model: Any, sample: Any) -> tuple:
    """``forward``'s arguments as Lightning reads ``example_input_array`` (a tuple is
    positional, a dict is by keyword), in the positional form the traced layers take."""
    if isinstance(sample, Mapping):
        return positional_arguments(forward_signature(model), (), dict(sample), type(model).__name__)
    return sample if isinstance(sample, tuple) else (sample,)


def profile_model(args: Any, say: Callable[[str], Any] = print) -> ModelProfile:
    """Load the model ``args.model`` names, find its layers (``args.layers``) and time them
    on ``example_input_array`` resized to ``args.batch_size``."""
    model = load_model(args.model)
    layers = layers_of(model, args.layers, say)
    arguments = _positional(model, sample_input_of(model, args.batch_size))
    profile = profile_layers(
        layers,
        arguments[0] if len(arguments) == 1 else arguments,  # what layer 0 gets, as from self(...) in a step
        device=args.device,
        repeats=args.repeats,
        warmup=args.warmup,
        cache_dir=args.cache_dir,
        name=args.name or args.model.split(":", 1)[1],
    )
    profile = with_action_overhead(profile, args.device)  # the executor's own cost per action here
    if isinstance(model, LightningModule):  # its own optimizer's step per layer
        profile = with_run_optimizer(profile, model, list(layers), torch.device(args.device))
    return profile


def sample_input_of(model: nn.Module, batch_size: int | None = None) -> Any:
    """``model.example_input_array``, optionally resized to ``batch_size`` samples."""
    sample = getattr(model, "example_input_array", None)
    require(
        sample is not None,
        "example_input_array",
        f"{type(model).__name__} has no example_input_array",
        "set self.example_input_array to one micro-batch of input in the model's __init__",
    )
    require(bool(list(iter_tensors(sample))), "example_input_array", "contains no tensor", "set it to a tensor or a tuple/dict of tensors")
    if batch_size is None:
        return sample
    require(batch_size > 0, "--batch-size", f"must be positive, got {batch_size}", "pass a positive number of samples")

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] == 0:
            return tensor
        index = torch.arange(batch_size, device=tensor.device) % tensor.shape[0]
        return tensor.index_select(0, index)

    return map_tensors(sample, resize)


def _human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def print_profile(profile: ModelProfile) -> None:
    """A rich table of the per-layer profile."""
    table = Table(title=f"{profile.name}: micro-batch {profile.micro_batch_size} on {profile.device}")
    for column in ("#", "layer", "fwd ms", "bwd ms", "B ms", "W ms", "opt ms", "output", "params", "stash"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for index, layer in enumerate(profile.layers):
        table.add_row(
            str(index),
            layer.name,
            f"{layer.forward_ms:.3f}",
            f"{layer.backward_ms:.3f}",
            f"{layer.input_grad_ms:.3f}",
            f"{layer.weight_grad_ms:.3f}",
            f"{layer.optimizer_ms:.3f}",
            _human_bytes(layer.output_bytes),
            _human_bytes(layer.param_bytes),
            _human_bytes(layer.stash_for(1.0)),
        )
    make_console().print(table)
    if not profile.action_overhead_ms.is_zero:
        own = ", ".join(f"{kind} {ms * 1000:.0f} us" for kind, ms in profile.action_overhead_ms.to_dict().items())
        make_console().print(f"executor overhead per action: {own}")
    if "optimizer" in profile.meta:
        make_console().print(f"optimizer step per layer: {profile.meta['optimizer']}")


def run(args: Any) -> int:
    """Profile the model the parsed ``args`` name and write the JSON; 2 on bad input."""
    try:
        profile = profile_model(args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(profile.to_json() + "\n")
    except DappleConfigError as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {args.out!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print_profile(profile)
    print(f"wrote {out}")
    return 0
