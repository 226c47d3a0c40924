"""Byte counts as people read them, in one place.

Two styles: binary units (``12.5 MiB``) for what the package measures and reports on this
machine, and the decimal units the DAPPLE paper prints its tables in (``548 MB``,
``2.6 GB``), used where a table is read beside the paper's.
"""
from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(num: float | None, paper: bool = False) -> str:
    """``num`` bytes in binary units, or in the paper's decimal style with ``paper``; "-" for None."""
    if num is None:
        return "-"
    value = float(num)
    if paper:
        for scale, unit, digits in ((1e9, "GB", 1), (1e6, "MB", 0), (1e3, "kB", 0)):
            if value >= scale:
                return f"{value / scale:.{digits}f} {unit}"
        return f"{value:.0f} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
