"""Vendor peak rates of the accelerators the recipe estimator can price (no torch here: the
command-line tools list them without loading it)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "DevicePeak"]


@dataclass(frozen=True)
class DevicePeak:
    """Vendor peak rates of one accelerator (dense; fp16 with tensor cores)."""

    name: str
    fp32_tflops: float
    fp16_tflops: float
    memory_bandwidth_gbs: float  # GB/s
    memory_gib: float


DEVICES: dict[str, DevicePeak] = {
    "V100": DevicePeak("V100-SXM2-16GB", 15.7, 125.0, 900.0, 16.0),
    "A100": DevicePeak("A100-SXM4-40GB", 19.5, 312.0, 1555.0, 40.0),
    "H100": DevicePeak("H100-SXM5-80GB", 67.0, 989.0, 3350.0, 80.0),
}
