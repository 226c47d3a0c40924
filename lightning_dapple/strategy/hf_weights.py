"""Each rank reads only its own stage's tensors from a ``save_pretrained`` directory.

A Hugging Face model too large for one process is made from its config on the meta device
(``meta_build.py``) and named with ``DappleStrategy(pretrained=directory)``: once the plan
is known, every rank gives the tensors of its own stage the values stored in the directory
and nothing else is read. ``accelerate``'s ``load_checkpoint_and_dispatch`` and
``torchtitan``'s seed checkpoints work this way too: the model's structure first, on no
memory, then each device's part straight from the files.

* **The files.** ``model.safetensors``, or the shards a ``model.safetensors.index.json``
  lists (its ``weight_map``: key -> file). ``safetensors.safe_open`` reads a file's header
  (names, shapes, dtypes) without its data, and ``get_tensor`` one tensor's bytes only;
  ``read`` keeps the keys it read, so a test can see what a rank touched.
* **The names.** A key is the tensor's name inside the Hugging Face model (the
  LightningModule's attribute path less the model's own, ``model.``). A checkpoint of the
  base model loads into a model with a head and the other way round, as ``from_pretrained``
  allows: the base model's prefix (``base_model_prefix``, ``model`` or ``transformer``) is
  tried away or added.
* **Tied weights** (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one
  tensor with several names; ``save_pretrained`` stores one of them, and whichever name
  the directory has gives the tensor its values.
* **What the directory lacks** (non-persistent buffers such as a rotary table's
  ``inv_freq``, never saved; a new head on a base checkpoint) keeps the values its own
  initialisation gives, replayed from the build's record: Hugging Face's own code computed
  them (``_init_weights`` and the modules' constructors). A parameter or persistent buffer
  missing from the directory is named once at set-up, as ``from_pretrained`` warns; a
  shape that differs from the model's is refused before training.
* **dtypes.** Each tensor is read in the dtype it was stored in and converted to the
  model's (``Trainer(precision="64-true")`` converts the meta model first), as
  ``from_pretrained`` followed by the precision's conversion gives.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.hf_layers import is_hf_model

__all__ = ["CheckpointFiles", "PretrainedWeights", "pretrained_weights"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointFiles:
    """The safetensors files of one ``save_pretrained`` directory, read one key at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, Any] = {}
        index, single = self.directory / _INDEX, self.directory / _SINGLE
        require(
            index.is_file() or single.is_file(),
            "DappleStrategy(pretrained)",
            f"names {str(self.directory)!r}, which holds neither {_SINGLE} nor {_INDEX}",
            "give the directory model.save_pretrained(directory) wrote (safetensors; torch .bin files are not read)",
        )
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {key: self.directory / name for key, name in weight_map.items()}
        else:
            self.file_of = {key: single for key in self._open(single).keys()}
        self.read_keys: list[str] = []  # every key read, in order

    def _open(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                from safetensors import safe_open
            except ImportError:  # transformers installs it
                raise DappleConfigError("DappleStrategy(pretrained)", "needs the safetensors package", "pip install safetensors") from None
            self._handles[path] = safe_open(str(path), framework="pt", device="cpu")  # the header only; data is mapped
        return self._handles[path]

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``, from its file's header (no tensor data is read)."""
        return tuple(self._open(self.file_of[key]).get_slice(key).get_shape())

    def read(self, key: str) -> torch.Tensor:
        """The stored tensor ``key`` (its bytes only)."""
        self.read_keys.append(key)
        return self._open(self.file_of[key]).get_tensor(key)

    def close(self) -> None:
        """Let go of the open files (the stage is made)."""
        self._handles.clear()


class PretrainedWeights:
    """The tensors of one or more Hugging Face models inside a LightningModule, from their
    directories; called as ``meta_build.Source`` (attribute paths, meta tensor -> values)."""

    def __init__(self, module: nn.Module, directories: Mapping[str, str | Path]) -> None:
        self.models: dict[str, tuple[nn.Module, CheckpointFiles]] = {
            path: (module.get_submodule(path) if path else module, CheckpointFiles(directory)) for path, directory in directories.items()
        }
        persistent = dict(module.state_dict(keep_vars=True))
        self.keys: dict[str, tuple[CheckpointFiles, str]] = {}  # the module's persistent names -> (files, key)
        self.missing: list[str] = []
        for name, tensor in persistent.items():
            found = self._find(name)
            if found is None:
                if self._model_of(name) is not None:
                    self.missing.append(name)
                continue
            files, key = found
            require(
                files.shape(key) == tuple(tensor.shape),
                "DappleStrategy(pretrained)",
                f"stores {key} with shape {list(files.shape(key))} in {files.directory}, but the model's {name} has shape {list(tensor.shape)}",
                "build the model from the directory's own config (AutoConfig.from_pretrained(directory))",
            )
            self.keys[name] = found
        # a tied weight stored under one of its names leaves none of them missing
        same = {name: id(tensor) for name, tensor in persistent.items()}
        found_ids = {same[name] for name in self.keys}
        self.missing = [name for name in self.missing if same[name] not in found_ids]
        self._loaded = {name for name in persistent if same[name] in found_ids}  # a tie's every name

    def _model_of(self, name: str) -> tuple[str, nn.Module, CheckpointFiles] | None:
        for path, (model, files) in self.models.items():
            if not path or name.startswith(path + "."):
                return name[len(path) + 1 :] if path else name, model, files
        return None

    def _find(self, name: str) -> tuple[CheckpointFiles, str] | None:
        """Where ``name`` is stored: its key in its model's directory, with the base model's
        prefix as stored (module docstring), or None."""
        owner = self._model_of(name)
        if owner is None:
            return None
        relative, model, files = owner
        prefix = getattr(model, "base_model_prefix", "")
        candidates = [relative]
        if prefix and relative.startswith(prefix + "."):
            candidates.append(relative[len(prefix) + 1 :])
        elif prefix:
            candidates.append(f"{prefix}.{relative}")
        return next(((files, key) for key in candidates if key in files.file_of), None)

    def loads(self, name: str) -> bool:
        """Whether ``name``'s values come from a directory (under it or another name of a tie)."""
        return name in self._loaded

    def __call__(self, names: list[str], like: torch.Tensor) -> torch.Tensor | None:
        for name in names:
            if name in self.keys:
                files, key = self.keys[name]
                return files.read(key)
        return None

    def close(self) -> None:
        for _, files in self.models.values():
            files.close()

    @property
    def read_keys(self) -> list[str]:
        """Every key read from every directory, in order."""
        return [key for _, files in self.models.values() for key in files.read_keys]


def _hf_models(module: nn.Module) -> list[str]:
    """The attribute paths of the outermost Hugging Face models inside ``module``."""
    found: list[str] = []
    for name, sub in module.named_modules():
        if is_hf_model(sub) and not any(name == path or name.startswith(path + ".") or not path for path in found):
            found.append(name)
    return found


def pretrained_weights(module: nn.Module, pretrained: Any, built_on_meta: bool) -> PretrainedWeights | None:
    """The directories ``DappleStrategy(pretrained=...)`` names, checked against the module
    on every rank alike before training (headers only): one directory for the module's one
    Hugging Face model, or ``{attribute path: directory}``."""
    if pretrained is None:
        return None
    owner = f"{type(module).__name__}"
    require(
        built_on_meta,
        "DappleStrategy(pretrained)",
        f"names weights for a model built on the meta device, but {owner} holds real tensors (built in __init__, or with meta_init=False)",
        "make the Hugging Face model from its config in configure_model (or under trainer.init_module(empty_init=True)), "
        "or leave pretrained out and call from_pretrained(directory) in __init__",
    )
    models = _hf_models(module)
    if isinstance(pretrained, (str, Path)):
        require(
            len(models) == 1,
            "DappleStrategy(pretrained)",
            f"names one directory, but {owner} holds {len(models)} Hugging Face models ({', '.join(models) or 'none'})",
            "give {attribute path: directory} for each model whose weights a directory holds",
        )
        directories: dict[str, str | Path] = {models[0]: pretrained}
    else:
        directories = dict(pretrained)
        unknown = [path for path in directories if path not in models]
        require(
            not unknown,
            "DappleStrategy(pretrained)",
            f"names {', '.join(unknown)}, which is not a Hugging Face model of {owner} (those are: {', '.join(models) or 'none'})",
            "key the directories by the attribute path of each model (e.g. {'model': directory} for self.model)",
        )
    weights = PretrainedWeights(module, directories)
    if weights.missing:  # as from_pretrained warns of the weights it initialises
        shown = ", ".join(weights.missing[:5]) + (f" and {len(weights.missing) - 5} more" if len(weights.missing) > 5 else "")
        places = ", ".join(str(files.directory) for _, files in weights.models.values())
        rank_zero_warn(f"DappleStrategy(pretrained): {shown} not in {places}: each keeps the values its own initialisation gives")
    return weights
