"""Out-of-order backprop keeps nothing across steps, and gradient buckets overlap the backward.

* Memory: a forward's layer outputs (and with them the autograd graph that saves them) are
  gone once their step is over, with ooo on and off, with recomputation: the W work of a
  micro-batch holds only the pairs it needs (``execute/weight_grad.py``), never the graph.
* Buckets: with a bucket per layer, every bucket of a replicated stage starts before the
  end of the step (overlapping the backward or the W work that follows it), and the
  parameters still equal single-device training.
"""
from __future__ import annotations

import pytest

from dist_harness import run_ranks
from memory_worker import bucketed_parameters, live_after_next_step
from ooo_worker import with_options

ONE_STAGE = {"global_batch_size": 12, "micro_batches": 4, "stages": [{"layers": [0, 5], "devices": [0]}]}
DP_2 = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}
STRAIGHT_2 = {"global_batch_size": 12, "micro_batches": 3, "stages": [{"layers": [0, 2], "devices": [0]}, {"layers": [2, 5], "devices": [1]}]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "ooo,recompute", [(False, "never"), (True, "never"), (True, "always")], ids=["plain", "ooo", "ooo-recompute"]
)
def test_nothing_of_a_step_survives_the_next(ooo: bool, recompute: str) -> None:
    plan = with_options(ONE_STAGE, "dapple", ooo, recompute)
    result = run_ranks(live_after_next_step, 1, plan, "transformer", timeout_s=240, raise_on_error=True)[0]
    assert result["split"] == ooo
    assert result["recorded"] > 0
    assert result["alive"] == 0, result
    assert result["after_own_step"] == 0, result


@pytest.mark.timeout(400)
def test_gradient_buckets_start_early_and_keep_single_device_gradients() -> None:
    cases = []
    for model in ("mlp", "transformer"):
        for ooo in (False, True):
            cases.append((model, with_options(DP_2, "dapple", ooo, "never"), 1))  # a bucket per layer
        cases.append((model, with_options(DP_2, "dapple", True, "never"), None))  # the default: one bucket
    cases.append(("mlp", with_options({**STRAIGHT_2, "stages": [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2, 3]}]}, "dapple", True, "always"), 1))
    results = run_ranks(bucketed_parameters, 4, cases, timeout_s=360, raise_on_error=True)
    for index, (model, data, bucket_bytes) in enumerate(cases):
        for rank in range(4):
            if rank >= sum(len(s["devices"]) for s in data["stages"]):
                continue
            res = results[rank][index]
            assert res["gap"] < 1e-10, (model, data, bucket_bytes, res)
            if bucket_bytes == 1:
                assert res["buckets"] > 1, res
                # every bucket starts as soon as its gradients are final, not at the end of the step
                assert res["early"] == res["buckets"], (model, data, res)
            else:
                assert res["buckets"] == 1, res
