"""Read a profile file: the JSON format of ``docs/formats.md`` or PipeDream's graph text.

One entry point for every tool that takes ``--profile``: the file's first character tells
the two formats apart, so users need not say which one they pass.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.graph_text import parse_graph_text
from lightning_dapple.profile.model_profile import ModelProfile, profile_from_dict


def load_profile(path: str | Path, profile_batch_size: int | None = None) -> ModelProfile:
    """Read a profile JSON file or a PipeDream graph text file (shared/profiles/).

    Graph files take their batch size from ``profile_batch_size`` or else from ``pbs-N``
    in the file name.
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
        return profile
    return parse_graph_text(text, name=path.name, profile_batch_size=profile_batch_size)
