"""What a user observes of a fit, in a form two fits can be compared by (``compare``)."""
from __future__ import annotations

import csv
import os
from typing import Any

import torch


def observe(trainer: Any, root: str, metrics: dict[str, dict[str, float]], order: list[list[int]], predictions: Any, warned: list[str]) -> dict[str, Any]:
    """Rank 0's view: the final checkpoint (parameters, optimizer state by parameter name,
    its keys), the metrics, the CSV logger's rows, the batches' order, the checkpoint files
    callbacks wrote, the predictions and the warnings."""
    checkpoint = torch.load(os.path.join(root, "final.ckpt"), weights_only=False, map_location="cpu")
    rows = []
    path = os.path.join(root, "csv", "version_0", "metrics.csv")
    if os.path.exists(path):
        with open(path, newline="") as handle:
            rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(handle)]
    written = sorted(name for name in os.listdir(os.path.join(root, "ckpt"))) if os.path.isdir(os.path.join(root, "ckpt")) else []
    return {
        "state": checkpoint["state_dict"],
        "keys": sorted(checkpoint.keys() - {"callbacks", "hparams_name", "hyper_parameters"}),
        "optimizer": _optimizer_by_name(checkpoint, list(checkpoint["state_dict"])),
        "schedulers": checkpoint.get("lr_schedulers", []),
        "loops_step": checkpoint["global_step"],
        "epoch": checkpoint["epoch"],
        "metrics": metrics,
        "csv": rows,
        "order": order,
        "checkpoint_files": written,
        "predictions": predictions,
        "warnings": warned,
    }


def _optimizer_by_name(checkpoint: dict[str, Any], keys: list[str]) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state by its name, whichever way the file keys it (a
    plain run by position in ``named_parameters`` order, the strategy by name)."""
    state = checkpoint["optimizer_states"][0]["state"]
    names = [k for k in keys if k in checkpoint["state_dict"]]
    out = {}
    for key, value in state.items():
        name = key if isinstance(key, str) else names[key]
        out[name] = {k: v for k, v in value.items()}
    return out


def differences(ours: dict[str, Any], plain: dict[str, Any], skip_metrics: tuple[str, ...] = (), tolerance: float = 1e-10) -> list[str]:
    """Every observable in which ``ours`` differs from ``plain`` (beyond ``tolerance``,
    relative, for numbers), as readable lines; logged names in ``skip_metrics`` are left out."""
    found = []
    if ours["keys"] != plain["keys"]:
        found.append(f"checkpoint keys {ours['keys']} != {plain['keys']}")
    if set(ours["state"]) != set(plain["state"]):
        found.append(f"state keys differ: {set(ours['state']) ^ set(plain['state'])}")
    for name, value in plain["state"].items():
        if name in ours["state"] and not _close(ours["state"][name], value, tolerance):
            found.append(f"parameter {name}: {_gap(ours['state'][name], value):.3g} apart")
    if set(ours["optimizer"]) != set(plain["optimizer"]):
        found.append(f"optimizer state for {sorted(ours['optimizer'])} != {sorted(plain['optimizer'])}")
    for name, entries in plain["optimizer"].items():
        for key, value in entries.items():
            theirs = ours["optimizer"].get(name, {}).get(key)
            if theirs is None or not _close(theirs, value, tolerance):
                found.append(f"optimizer {name}.{key} differs")
    for what in ("loops_step", "epoch", "order", "checkpoint_files", "schedulers"):
        if ours[what] != plain[what]:
            found.append(f"{what}: {ours[what]} != {plain[what]}")
    for stage, values in plain["metrics"].items():
        mine = ours["metrics"].get(stage, {})
        if set(mine) != set(values):
            found.append(f"{stage} metrics' names {sorted(mine)} != {sorted(values)}")
        found += [f"{stage} metric {k}: {mine.get(k)} != {v}" for k, v in values.items() if k not in skip_metrics and not _close(mine.get(k), v, tolerance)]
    if len(ours["csv"]) != len(plain["csv"]):
        found.append(f"CSV rows {len(ours['csv'])} != {len(plain['csv'])}")
    for index, (mine, theirs) in enumerate(zip(ours["csv"], plain["csv"])):
        if set(mine) != set(theirs):
            found.append(f"CSV row {index} columns {sorted(mine)} != {sorted(theirs)}")
            continue
        found += [f"CSV row {index} {k}: {mine[k]} != {v}" for k, v in theirs.items() if k not in skip_metrics and not _close(float(mine[k]), float(v), tolerance)]
    if (ours["predictions"] is None) != (plain["predictions"] is None) or (
        plain["predictions"] is not None and not _close(ours["predictions"], plain["predictions"], tolerance)
    ):
        found.append("predictions differ")
    return found


def _close(a: Any, b: Any, tolerance: float) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tolerance, atol=tolerance))
    return abs(float(a) - float(b)) <= tolerance * max(1.0, abs(float(b)))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
