"""``dapple-profile``: measure a per-layer profile of a model and write it as JSON.

The profile is the planner's only knowledge of the model (DAPPLE 4.1); this command
produces it the way PipeDream's profiler does (PipeDream 3.2): each layer is timed on one
device for one micro-batch. See ``lightning_dapple.profile.profiler`` for what is measured.

    dapple-profile --model my_pkg.models:make_model --layers encoder.blocks \\
        --batch-size 8 --device cuda --out profile.json

``--model`` names a callable (``module:attr``) returning an ``nn.Module`` or a
``LightningModule``, or a class instantiated with no arguments. The sample micro-batch is
the module's ``example_input_array`` (the Lightning convention); ``--batch-size`` resizes
its leading dimension. Bad input prints one ``error: ...`` line and exits with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from typing import TYPE_CHECKING

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.model_profile import ModelProfile

if TYPE_CHECKING:  # torch loads only when a model is profiled: ``--help`` answers at once
    from torch import nn

__all__ = ["main", "build_parser", "load_model", "resolve_layers", "sample_input_of"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapple-profile",
        description="Measure per-layer forward/backward time, output, parameter and stash sizes (DAPPLE 4.1).",
    )
    parser.add_argument("--model", required=True, help="import path 'pkg.module:factory' of a callable or class returning the model")
    parser.add_argument("--layers", default="layers", help="attribute holding the layer sequence; dotted paths allowed (default: layers)")
    parser.add_argument("--batch-size", type=int, default=None, help="resize example_input_array's leading dimension to N samples")
    parser.add_argument("--device", default="cpu", help="device to time each layer on (default: cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per layer; the median is kept (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per layer first (default: 2)")
    parser.add_argument("--cache-dir", default=None, help="reuse a stored profile of the same layers/input/device from this folder")
    parser.add_argument("--name", default=None, help="profile name (default: the factory name)")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    return parser


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
    from torch import nn

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


def sample_input_of(model: nn.Module, batch_size: int | None = None) -> Any:
    """``model.example_input_array``, optionally resized to ``batch_size`` samples."""
    import torch

    from lightning_dapple.profile.profiler import iter_tensors, map_tensors
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
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{profile.name}: micro-batch {profile.micro_batch_size} on {profile.device}")
    for column in ("#", "layer", "fwd ms", "bwd ms", "B ms", "W ms", "output", "params", "stash"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for index, layer in enumerate(profile.layers):
        table.add_row(
            str(index),
            layer.name,
            f"{layer.forward_ms:.3f}",
            f"{layer.backward_ms:.3f}",
            f"{layer.input_grad_ms:.3f}",
            f"{layer.weight_grad_ms:.3f}",
            _human_bytes(layer.output_bytes),
            _human_bytes(layer.param_bytes),
            _human_bytes(layer.stash_bytes),
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_dapple.profile.profiler import profile_layers

    try:
        model = load_model(args.model)
        layers = resolve_layers(model, args.layers)
        sample = sample_input_of(model, args.batch_size)
        profile = profile_layers(
            layers,
            sample,
            device=args.device,
            repeats=args.repeats,
            warmup=args.warmup,
            cache_dir=args.cache_dir,
            name=args.name or args.model.split(":", 1)[1],
        )
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


if __name__ == "__main__":
    sys.exit(main())
