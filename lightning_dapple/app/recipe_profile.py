"""Layer profiles of the recipes, for planning on hardware this machine does not have.

``dapple-plan --recipe bert --cluster paper-a`` needs per-layer times of the full-size
model on the cluster's devices. Two sources, in this order:

1. the published V100 profiles the DAPPLE authors planned with (``shared/profiles/dapple``:
   ``bert-48-pbs-2.txt``, ``gnmt-16-pbs-64.txt``, ``vgg-19-pbs-32.txt``; PipeDream graph
   text), found through ``$DAPPLE_SHARED_PROFILES`` or ``<repo>/../shared/profiles``. Their
   layers are the authors' graph nodes, not this package's layer list, so a plan made from
   them reproduces the paper's planning (Table 4) but its layer ranges do not index
   ``lightning_dapple.models``;
2. an estimate (``ModelProfile.estimated=True``) for the recipe's own model: every layer
   runs once on the meta device under ``torch.utils.flop_counter.FlopCounterMode`` with a
   micro-batch of the profile size; backward is charged twice the forward FLOPs; bytes
   moved are parameters + input + output + saved activations (twice that for backward);
   each time is ``max(flops / peak FLOP/s, bytes / memory bandwidth)`` with the device's
   peak rates (``DEVICES``). Peak rates are never reached, so the times are lower bounds;
   what matters to the planner is how they compare between layers and with transfers.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from lightning_dapple.app.config import compose_recipe, recipe_names
from lightning_dapple.app.devices import DEVICES, DevicePeak
from lightning_dapple.errors import DappleConfigError, require
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.profile.model_profile import ModelProfile

__all__ = [
    "DEVICES",
    "DevicePeak",
    "PROFILE_BATCH",
    "SHARED_PROFILES",
    "recipe_global_batch",
    "recipe_profile",
    "shared_profile_path",
    "shared_profiles_dir",
]


# The published profile of each full-size recipe (DAPPLE's benchmark models).
SHARED_PROFILES: dict[str, str] = {
    "bert": "bert-48-pbs-2.txt",
    "gnmt": "gnmt-16-pbs-64.txt",
    "vgg": "vgg-19-pbs-32.txt",
}

# Micro-batch size of an estimated profile: the published profiles' sizes, so both agree.
PROFILE_BATCH: dict[str, int] = {"bert": 2, "gnmt": 64, "vgg": 32}
TINY_PROFILE_BATCH = 8


def shared_profiles_dir() -> Path | None:
    """``$DAPPLE_SHARED_PROFILES``, else ``<repo>/../shared/profiles`` (also tried from the cwd)."""
    candidates = []
    env = os.environ.get("DAPPLE_SHARED_PROFILES")
    if env:
        candidates.append(Path(env))
    repo = Path(__file__).resolve().parents[2]
    candidates += [repo.parent / "shared" / "profiles", Path.cwd().parent / "shared" / "profiles", Path.cwd() / "shared" / "profiles"]
    for path in candidates:
        if path.is_dir():
            return path
    return None


def shared_profile_path(name: str) -> Path | None:
    """The published profile file of recipe ``name`` if it is on this machine."""
    file = SHARED_PROFILES.get(name)
    root = shared_profiles_dir()
    if file is None or root is None:
        return None
    for path in (root / "dapple" / file, root / file):
        if path.is_file():
            return path
    return None


def _recipe_config(name: str) -> Any:
    try:
        return compose_recipe(name)
    except MissingConfigException:
        raise DappleConfigError("recipe", f"{name!r} is not a recipe", f"use one of {recipe_names()}") from None


def recipe_global_batch(name: str) -> int:
    """The global batch size of recipe ``name`` (DAPPLE Table 4 for the full-size ones)."""
    return int(_recipe_config(name).data.batch_size)


def recipe_profile(name: str, device: str = "V100", prefer_shared: bool = True, precision: str = "fp32") -> ModelProfile:
    """A layer profile of recipe ``name`` on ``device`` (one of ``DEVICES``).

    With ``prefer_shared`` the published V100 profile is used when the recipe has one and
    it is on this machine (and ``device`` is V100, the device it was measured on);
    otherwise the FLOP/byte estimate of the recipe's model (``estimated=True``).
    """
    require(device in DEVICES, "device", f"is {device!r}", f"use one of {sorted(DEVICES)}")
    require(precision in ("fp32", "fp16"), "precision", f"is {precision!r}", "use fp32 or fp16")
    cfg = _recipe_config(name)
    if prefer_shared and device == "V100":
        path = shared_profile_path(name)
        if path is not None:
            profile = load_profile(path)
            return ModelProfile(
                micro_batch_size=profile.micro_batch_size,
                layers=profile.layers,
                device="V100",
                name=f"{name} ({path.name})",
                input_bytes=profile.input_bytes,
                estimated=profile.estimated,
                meta={**profile.meta, "source": str(path), "recipe": name},
            )
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_cfg, dict)
    base = str(model_cfg.pop("name"))
    rows = PROFILE_BATCH.get(name, TINY_PROFILE_BATCH)
    from lightning_dapple.app.recipe_estimate import estimate_profile  # torch: only for estimates

    return estimate_profile(base, model_cfg, rows, DEVICES[device], precision=precision, name=f"{name} (estimate, {device} {precision})")
