"""Measured activation memory for graph-text profiles (``profile/activation_memory.py``):
the stash is scaled to it, the shared profiles get their authors' values, and it decides
how large a data-parallel micro-batch fits (DAPPLE 6.3)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import shared_profiles

from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.baselines import data_parallel_candidates
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.profile import load_profile
from lightning_dapple.profile.activation_memory import PUBLISHED, with_activation_memory

PROFILES = shared_profiles()
XLNET = PROFILES / "dapple" / "xlnet-36-pbs-1.txt"


def test_stash_is_scaled_to_the_measurement_keeping_its_shape() -> None:
    plain = load_profile(XLNET, activation_bytes_per_sample=0)
    scaled = with_activation_memory(plain, 6e9, "test")
    assert sum(layer.stash_bytes for layer in scaled.layers) == pytest.approx(6e9 * plain.micro_batch_size)
    ratios = {round(a.stash_bytes / b.stash_bytes, 9) for a, b in zip(scaled.layers, plain.layers) if b.stash_bytes}
    assert len(ratios) == 1
    assert [layer.forward_ms for layer in scaled.layers] == [layer.forward_ms for layer in plain.layers]
    assert scaled.meta["activation_memory"]["source"] == "test"


def test_shared_profiles_get_their_authors_values_unless_told_otherwise() -> None:
    published, source = PUBLISHED[XLNET.name]
    profile = load_profile(XLNET)
    assert sum(layer.stash_bytes for layer in profile.layers) == pytest.approx(published)
    assert profile.meta["activation_memory"]["source"] == source
    given = load_profile(XLNET, activation_bytes_per_sample=1e9)
    assert sum(layer.stash_bytes for layer in given.layers) == pytest.approx(1e9)
    bare = load_profile(XLNET, activation_bytes_per_sample=0)
    assert "activation_memory" not in bare.meta
    assert sum(layer.stash_bytes for layer in bare.layers) < published / 50  # outputs only


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_values_are_refused(value: float) -> None:
    with pytest.raises(DappleConfigError, match="activation_bytes_per_sample"):
        load_profile(XLNET, activation_bytes_per_sample=value)


def test_measured_memory_limits_the_data_parallel_micro_batch() -> None:
    # XLNet-36, 8 samples per V100: with layer outputs alone all 8 fit in one micro-batch
    # (M = 1, the whole backward hides the AllReduce); with the authors' 5.9 GB per sample
    # only one sample fits next to 8 GB of weights, gradients and Adam state, so DP
    # accumulates 8 micro-batches and only the last one's backward overlaps the AllReduce.
    cluster = load_cluster("paper-a")
    best = {}
    for label, value in (("outputs", 0), ("measured", None)):
        request = PlanRequest.build(load_profile(XLNET, activation_bytes_per_sample=value), cluster, 128)
        fitting = [item for item in data_parallel_candidates(request) if item.fits(cluster)]
        best[label] = fitting[0]
    assert best["outputs"].micro_batches == 1
    assert best["measured"].micro_batches == 8
    assert best["measured"].latency_ms > best["outputs"].latency_ms


def test_plan_cli_takes_and_reports_it() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "lightning_dapple.cli.plan", "--profile", str(XLNET), "--cluster", "paper-a",
         "--global-batch-size", "128", "--activation-bytes-per-sample", "2e9"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "activation memory: 2.00 GB per sample (given)" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "lightning_dapple.cli.plan", "--profile", str(XLNET), "--cluster", "paper-a",
         "--global-batch-size", "128", "--activation-bytes-per-sample", "-3"],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "activation_bytes_per_sample" in bad.stderr
