"""Read a profile file: the JSON format of ``docs/formats.md`` or PipeDream's graph text.

One entry point for every tool that takes ``--profile``: the file's first character tells
the two formats apart, so users need not say which one they pass.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.activation_memory import published_activation_bytes, with_activation_memory
from lightning_dapple.profile.graph_text import parse_graph_text
from lightning_dapple.profile.model_profile import ModelProfile, profile_from_dict


def load_profile(path: str | Path, profile_batch_size: int | None = None, activation_bytes_per_sample: float | None = None) -> ModelProfile:
    """Read a profile JSON file or a PipeDream graph text file (shared/profiles/).

    Graph files take their batch size from ``profile_batch_size`` or else from ``pbs-N``
    in the file name. ``activation_bytes_per_sample`` (peak activation memory of one sample
    through the whole model) rescales the layers' stash (``activation_memory``); left out,
    a shared graph profile gets the value its authors planned it with, if they gave one,
    and 0 keeps the stash the file implies.
    """
    path = Path(path)
    require(path.is_file(), "profile", f"file {str(path)!r} does not exist", "pass the path of a profile JSON or graph.txt file")
    text = path.read_text()
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DappleConfigError(f"profile {path.name}", f"is not valid JSON ({exc.msg} at line {exc.lineno})", "fix the JSON syntax") from None
        profile = profile_from_dict(data, source=f"profile {path.name}")
        if profile_batch_size is not None:
            profile = replace(profile, micro_batch_size=profile_batch_size)
        published = None
    else:
        profile = parse_graph_text(text, name=path.name, profile_batch_size=profile_batch_size)
        published = published_activation_bytes(path.name)
    if activation_bytes_per_sample is None and published is not None:
        return with_activation_memory(profile, *published)
    if activation_bytes_per_sample:
        return with_activation_memory(profile, activation_bytes_per_sample, "given")
    return profile
