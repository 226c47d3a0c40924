"""Activation memory a graph-text profile does not record.

A PipeDream graph-text profile gives each node's *output* size. What a layer keeps for its
backward is usually far more: a transformer layer stashes its attention maps and
feed-forward intermediates, tens of times its output (XLNet-24 at one sample: 2 MB of
layer outputs, 3.9 GB measured at peak). The memory side of the planner (DAPPLE 5.3: K_i
micro-batches in flight, each with its stash) then lets plans through that cannot run, and
data parallelism looks able to run large micro-batches whose backward hides the gradient
AllReduce (DAPPLE 6.3: "the memory requirement for BERT is much smaller and thus allows
more micro-batches on a single device. More computation per-step implies more backward
computation time can be leveraged for overlapping comm overhead").

The DAPPLE authors' planner takes this number as an input beside the profile, the *peak
activation memory per sample* (``peak_activation_per_batch`` in their planner, HPGO;
``examples/vs_pipedream.rs`` and ``planner/tests/speedup_test.rs`` of the published
planner). ``with_activation_memory`` applies such a measurement: every layer's
per-sample ``stash_bytes`` is scaled by one factor so that the per-sample stash of the
whole model for one sample equals it; the profile's layer-to-layer shape is kept. The whole
part (``stash_whole_bytes``: a saved rotary table or mask, one copy per slice whatever its
rows) is not a per-sample quantity and stays as measured. ``PUBLISHED`` holds the
values the authors planned the shared profiles with, applied by ``load_profile`` unless
the caller gives one (``dapple-plan --activation-bytes-per-sample``).
"""
from __future__ import annotations

import math
from dataclasses import replace

from lightning_dapple.errors import require
from lightning_dapple.profile.model_profile import ModelProfile, span_stash_per_sample

__all__ = ["PUBLISHED", "published_activation_bytes", "with_activation_memory"]

_XLNET_24 = 3942774528.0  # measured XLNet-24 (the authors' XLNet-36 inputs are 1.5x this)
_BERT_LARGE = 1736689664.0  # measured BERT-Large, 24 layers (BERT-48: 2x this)
_AMOEBA = 250845152.0  # the authors' AmoebaNet base value (AmoebaNet-36: 1.5x this)

# Profile file name -> (peak activation bytes per sample, where the authors give it).
PUBLISHED: dict[str, tuple[float, str]] = {
    "xlnet-24-pbs-1.txt": (_XLNET_24, "HPGO planner tests, xlnet"),
    "xlnet-36-pbs-1.txt": (_XLNET_24 * 1.5, "HPGO examples/vs_pipedream.rs, XLNet 36 (XLNet-24 x 1.5)"),
    "bert-24-pbs-6.txt": (_BERT_LARGE, "HPGO examples/vs_pipedream.rs, BERT Large"),
    "bert-48-pbs-2.txt": (_BERT_LARGE * 2.0, "HPGO examples/bert_speedup.rs, BERT-48 (BERT-24 x 2)"),
    "amoeba-36-pbs-1.txt": (_AMOEBA * 1.5, "HPGO examples/vs_pipedream.rs, AmoebaNet-D 36"),
    "gnmt-16-pbs-64.txt": (1e8, "HPGO examples/gnmt_scalability.rs, GNMT-16"),
    "vgg-19-pbs-32.txt": (7e7, "HPGO examples/vs_pipedream.rs, VGG-19"),
    "resnet50.graph.txt": (7e7, "DAPPLE PLANNER_REPRODUCTION.md, ResNet-50"),
}


def published_activation_bytes(file_name: str) -> tuple[float, str] | None:
    """(bytes per sample, source) the authors planned the shared profile ``file_name``
    with, or None."""
    return PUBLISHED.get(file_name)


def with_activation_memory(profile: ModelProfile, bytes_per_sample: float, source: str) -> ModelProfile:
    """``profile`` with every layer's per-sample stash scaled so that one sample stashes
    ``bytes_per_sample`` through the whole model (recorded in ``meta``); the whole part of
    the stash is left as it is (module docstring)."""
    require(
        isinstance(bytes_per_sample, (int, float)) and not isinstance(bytes_per_sample, bool)
        and math.isfinite(bytes_per_sample) and bytes_per_sample > 0,
        "activation_bytes_per_sample",
        f"must be a positive number of bytes, got {bytes_per_sample!r}",
        "give the peak activation memory of one sample through the whole model, e.g. 5.9e9",
    )
    stashed = span_stash_per_sample(profile.layers)
    require(
        stashed > 0,
        "activation_bytes_per_sample",
        f"cannot be spread over {profile.name}: its layers stash nothing per sample",
        "give the profile's layers stash_bytes (the per-sample part), or leave the activation memory out",
    )
    factor = bytes_per_sample * profile.micro_batch_size / stashed
    layers = tuple(
        replace(layer, stash_bytes=layer.stash_bytes * factor, stash_shared_bytes=layer.stash_shared_bytes * factor) for layer in profile.layers
    )
    note = {"bytes_per_sample": float(bytes_per_sample), "source": source, "scale": factor}
    return replace(profile, layers=layers, meta={**profile.meta, "activation_memory": note})
