"""What the profile's per-kind time tables (``action_overhead_ms``, ``step_glue_ms``) share:
every entry a finite number of milliseconds >= 0, keys from a fixed set, all zero when the
profile does not say, and their JSON form."""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, ClassVar, Mapping

from lightning_dapple.errors import DappleConfigError, require

__all__ = ["MsTable", "checked_ms", "ms_table"]


def checked_ms(value: Any, where: str, fix: str) -> float:
    """``value`` as a float, or ``DappleConfigError`` naming ``where`` unless it is a finite
    number >= 0 (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DappleConfigError(where, f"must be a finite number >= 0, got {value!r}", fix)
    return float(value)


def ms_table(data: Any, keys: Mapping[str, str], source: str, noun: str, fix: str) -> dict[str, float]:
    """The JSON object ``data`` ({key: milliseconds}, a key left out is left out) as
    {field name: milliseconds} through ``keys`` (JSON key -> field); unknown keys are refused."""
    require(isinstance(data, dict), source, "is not a JSON object", f"write {{{noun}: milliseconds}} for {noun}s {list(keys)}")
    unknown = sorted(set(data) - set(keys))
    require(not unknown, source, f"has unknown {noun}s {unknown}", f"use the {noun}s {list(keys)}")
    return {keys[key]: checked_ms(value, f"{source}.{key}", fix) for key, value in data.items()}


class MsTable:
    """Base of a frozen dataclass of milliseconds fields: ``JSON_NAME`` is its key in the
    profile, ``KEYS`` maps JSON keys to fields, ``FIX`` says how to write a bad entry."""

    JSON_NAME: ClassVar[str]
    KEYS: ClassVar[Mapping[str, str]]
    FIX: ClassVar[str]

    def __post_init__(self) -> None:
        for item in fields(self):  # type: ignore[arg-type]
            checked_ms(getattr(self, item.name), f"{self.JSON_NAME}.{item.name}", f"{self.FIX} (or leave {self.JSON_NAME} out: none)")

    @property
    def is_zero(self) -> bool:
        return not any(getattr(self, item.name) for item in fields(self))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, float]:
        return {key: getattr(self, name) for key, name in self.KEYS.items()}
