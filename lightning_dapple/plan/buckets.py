"""Gradient buckets: which layers' gradients are AllReduced together, and in what order.

A replicated stage does not wait for its whole backward before synchronising gradients:
like torch DDP (and Horovod, DAPPLE's TF runtime, ooo-backprop's bucketed ending phase,
ooo-backprop sec. 4), it groups the gradients of consecutive layers into buckets of about
``BUCKET_BYTES`` and launches a bucket's AllReduce as soon as the last backward of its
layers has produced them, overlapping the backward of the earlier layers. The backward
runs from the last layer to the first, so buckets are filled from the back.

This one function is used by the executor (its real buckets), the cost model and the
simulator (what they charge), so the three agree on which gradients travel together.
"""
from __future__ import annotations

from typing import Sequence

from lightning_dapple.errors import require

#: torch DDP's default ``bucket_cap_mb`` (25 MiB), shared by executor and cost model.
BUCKET_BYTES = 25 * 2**20


def bucket_layers(
    param_bytes_per_layer: Sequence[int],
    start: int,
    end: int,
    bucket_bytes: int = BUCKET_BYTES,
) -> list[tuple[int, int]]:
    """Split the layer range ``[start, end)`` into gradient buckets, in launch order.

    Layers are added from the back (``end - 1`` first) until a bucket holds at least
    ``bucket_bytes`` parameter bytes; then the next bucket starts. A layer is never split,
    so one large layer makes a bucket on its own. Returns ``(lo, hi)`` layer ranges, the
    first covering the last layers (its gradients are ready first). The buckets cover the
    whole range, layers without parameters included; a bucket of zero bytes has nothing to
    reduce and its consumer may skip it. An empty range gives no buckets.
    """
    require(0 <= start <= end <= len(param_bytes_per_layer), "bucket range",
            f"[{start}, {end}) is outside the {len(param_bytes_per_layer)} layers",
            "pass 0 <= start <= end <= number of layers")
    require(bucket_bytes > 0, "bucket_bytes", f"is {bucket_bytes}", "use a positive byte count")
    buckets: list[tuple[int, int]] = []
    hi = end
    filled = 0
    for layer in range(end - 1, start - 1, -1):
        filled += param_bytes_per_layer[layer]
        if filled >= bucket_bytes:
            buckets.append((layer, hi))
            hi = layer
            filled = 0
    if hi > start:
        buckets.append((start, hi))
    return buckets
