"""ZeRO-1 and ZeRO-2 inside replicated stages (``strategy/zero.py``): each replica keeps its
share of the optimizer state (and under ZeRO-2 of the gradients), steps it and sends what it
stepped to the others. Training with gradient clipping equals one process in float64 on a
data-parallel plan and on a 2x2 hybrid plan, with out-of-order backprop and with
recomputation; the state and gradients per replica are their shares; consolidated and
sharded checkpoints resume under another plan; fp16 mixed precision with clipping gives
what the unsharded strategy gives.

The fits of each plan run in one process group (``zero_worker.py``), 2 processes for the
data-parallel plan, 4 for the hybrid one; the plain references run in this process."""
from __future__ import annotations

import io
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_dapple  # noqa: F401
import zero_worker
from conformance.behaviours import Classifier
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.execute.clipping import clip_grad_norm_global
from lightning_dapple.execute.launch import ERRORS_KEY, run_ranks
from lightning_dapple.strategy import DappleStrategy
from lightning_dapple.strategy.zero import assign_owners

BATCH = 8
DP = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1]}]}
TWO_STAGES = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0]}, {"layers": [3, 5], "devices": [1]}]}
HYBRID = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}]}
HYBRID_OTHER_CUT = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 2], "devices": [0, 1]}, {"layers": [2, 5], "devices": [2, 3]}]}
DP4 = {"global_batch_size": BATCH, "micro_batches": 2, "stages": [{"layers": [0, 5], "devices": [0, 1, 2, 3]}]}
OOO = {"ooo": True, "recompute": "never"}
RECOMPUTE = {"ooo": False, "recompute": "always"}


def _variants(prefix: str, plan: dict) -> list[dict[str, Any]]:
    """zero 1 and 2, each with out-of-order backprop (consolidated checkpoint, a gradient
    bucket per layer) and with recomputation (sharded checkpoint)."""
    return [
        {"name": f"{prefix}_z{zero}_{kind}", "plan": plan, "zero": zero, "options": {**options, **extra}, **more}
        for zero in (1, 2)
        for kind, options, extra, more in (("ooo", OOO, {}, {"bucket_bytes": 200}), ("recompute", RECOMPUTE, {"checkpoint": "sharded"}, {}))
    ]


#: the fits of each process group, run in this order; a "resume" fit starts from the end
#: checkpoint of the fit it names and trains a second epoch
FITS: dict[int, list[dict[str, Any]]] = {
    2: [
        *_variants("dp", DP),
        {"name": "dp_z2_ooo_to_two_stages", "plan": TWO_STAGES, "zero": 0, "epochs": 2, "resume": "dp_z2_ooo"},
        {"name": "dp_z2_recompute_to_two_stages", "plan": TWO_STAGES, "zero": 0, "epochs": 2, "resume": "dp_z2_recompute"},
        *({"name": f"dp_z{zero}_fp16", "plan": DP, "zero": zero, "precision": "16-mixed", "options": OOO} for zero in (0, 1, 2)),
        {"name": "dp_z2_accumulate", "plan": DP, "zero": 2, "accumulate": 2, "options": RECOMPUTE},
    ],
    4: [
        *_variants("hybrid", HYBRID),
        {"name": "hybrid_z1_ooo_to_dp4", "plan": DP4, "zero": 0, "epochs": 2, "resume": "hybrid_z1_ooo"},
        {"name": "hybrid_z2_ooo_to_dp4", "plan": DP4, "zero": 2, "epochs": 2, "resume": "hybrid_z2_ooo"},
        {"name": "hybrid_z1_recompute_to_other_cut", "plan": HYBRID_OTHER_CUT, "zero": 1, "epochs": 2, "resume": "hybrid_z1_recompute"},
        {"name": "hybrid_z2_recompute_to_other_cut", "plan": HYBRID_OTHER_CUT, "zero": 2, "epochs": 2, "resume": "hybrid_z2_recompute"},
    ],
}
TRAINED = [fit["name"] for world in FITS for fit in FITS[world] if not {"resume", "precision", "accumulate"} & set(fit)]
RESUMED = [fit["name"] for world in FITS for fit in FITS[world] if "resume" in fit]


def test_shares_are_balanced_and_the_same_on_every_replica() -> None:
    params = [torch.empty(n) for n in (100, 10, 60, 50, 5, 5)]
    owners = assign_owners(params, 2)
    assert owners == assign_owners(params, 2)
    loads = [sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(p.numel() for p in params)
    assert sorted(set(assign_owners(params, 3))) == [0, 1, 2]


def test_zero_other_than_0_1_or_2_is_refused() -> None:
    with pytest.raises(DappleConfigError, match=r"zero: is 3\..*Fix: use .*2"):
        DappleStrategy(plan=DP, zero=3)


def test_clipping_counts_a_shared_parameter_on_its_owner_only() -> None:
    """Two replicas, one process seen: a parameter every replica holds counts half, one this
    replica owns counts whole, one another replica owns not at all (its gradient may be
    stale: fp16's scaled one), a tied one owned here counts replicas/holders."""
    whole, mine, theirs, tied = (torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(4))
    for param, grad in ((whole, [3.0, 4.0]), (mine, [1.0, 2.0]), (theirs, [1e4, 1e4]), (tied, [2.0, 0.0])):
        param.grad = torch.tensor(grad, dtype=torch.float64)
    norm = clip_grad_norm_global(
        [whole, mine, theirs, tied], 1e9, 2, None, copies={id(tied): 4}, shares={id(mine): True, id(theirs): False, id(tied): True}
    )
    assert float(norm) == pytest.approx((25 / 2 + 5 + 4 * 2 / 4) ** 0.5, rel=1e-12)


# -- fits in process groups --------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zero")


@lru_cache(maxsize=None)
def _ours(world: int, root: Path) -> list[dict[str, Any]]:
    """Each rank's results of every fit of the ``world``-process group, by fit name."""
    results = run_ranks(zero_worker.fits, world, FITS[world], str(root / f"ours{world}"), timeout_s=900)
    assert ERRORS_KEY not in results, results.get(ERRORS_KEY)
    return [torch.load(io.BytesIO(results[rank]), weights_only=False) for rank in range(world)]


def _fit(name: str, root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fit's definition and each rank's results."""
    world = next(world for world, fits in FITS.items() if any(fit["name"] == name for fit in fits))
    return next(fit for fit in FITS[world] if fit["name"] == name), [ranks[name] for ranks in _ours(world, root)]


@lru_cache(maxsize=None)
def _plain(root: Path, precision: str = "64-true", epochs: int = 1, clip: float | None = zero_worker.CLIP, accumulate: int = 1) -> dict[str, Any]:
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = fabric_rank_zero.rank = 0  # the user's own process; an earlier test may have left another
    where = root / f"plain_{precision}_{epochs}_{clip}_{accumulate}"
    where.mkdir()
    return zero_worker.plain(str(where), precision, epochs, clip, accumulate)


def _by_name(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state by parameter name (a plain run keys it by position)."""
    names = list(checkpoint["state_dict"])
    return {names[key] if isinstance(key, int) else key: state for key, state in checkpoint["optimizer_states"][0]["state"].items()}


def _gap(ours: dict[str, Any], plain: dict[str, Any]) -> float:
    """The largest difference of a parameter or of its optimizer state, relative to its size."""
    gaps = [float((ours["state_dict"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12)) for k, v in plain["state_dict"].items()]
    mine, theirs = _by_name(ours), _by_name(plain)
    assert set(mine) == set(theirs)  # every share saved
    for name, state in theirs.items():
        for field in ("exp_avg", "exp_avg_sq"):
            gaps.append(float((mine[name][field] - state[field]).abs().max() / state[field].abs().max().clamp(min=1e-12)))
    return max(gaps)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", TRAINED)
def test_zero_trains_like_one_process_with_clipping(name: str, root: Path) -> None:
    """3 AdamW steps with gradient clipping: parameters and optimizer state equal one process
    in float64 (clipping matters here: without it one process ends elsewhere)."""
    _, ranks = _fit(name, root)
    plain = _plain(root)
    assert _gap(ranks[0]["checkpoint"], plain) < 1e-10
    assert _gap(_plain(root, clip=None), plain) > 1e-6


@pytest.mark.timeout(900)
def test_zero_2_accumulating_gradients_over_batches_trains_like_one_process(root: Path) -> None:
    """Trainer(accumulate_grad_batches=2): each batch's gradients reach the owners, which add
    them up over the window; the others hold none. Equal to one process accumulating alike."""
    _, ranks = _fit("dp_z2_accumulate", root)
    assert _gap(ranks[0]["checkpoint"], _plain(root, accumulate=2)) < 1e-10
    assert _gap(_plain(root), _plain(root, accumulate=2)) > 1e-6


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", RESUMED)
def test_a_zero_checkpoint_resumes_under_another_plan(name: str, root: Path) -> None:
    """A consolidated or sharded checkpoint of ZeRO-1/-2 replicas, resumed for a second epoch
    under another plan (with or without ZeRO, other replica counts and cuts), equals one
    process trained for both epochs."""
    _, ranks = _fit(name, root)
    assert _gap(ranks[0]["checkpoint"], _plain(root, epochs=2)) < 1e-10


def _stage_bytes(layers: tuple[int, int], per_element: int) -> int:
    model = Classifier()
    return sum(p.numel() * per_element for layer in model.layers[layers[0] : layers[1]] for p in layer.parameters())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [name for name in TRAINED if name.endswith("_ooo")])
def test_each_replica_holds_its_share_of_state_and_gradients(name: str, root: Path) -> None:
    """Each replica's optimizer state (Adam's two moments and a step count per parameter)
    is its share: the replicas' together are the stage's. Under ZeRO-2 so are the gradients
    it holds at each step, under ZeRO-1 every replica holds the stage's. Every gradient
    bucket (a layer each) is launched during the backward, under ZeRO-2 to the owners."""
    fit, ranks = _fit(name, root)
    for rank in ranks:
        assert rank["buckets"] == [rank["buckets"][0]] * 3 and len(rank["buckets"]) == 3
        count, early, to_owners = rank["buckets"][0]
        assert early == count >= 1 and to_owners == (fit["zero"] == 2)
    assert ranks[0]["buckets"][0][0] >= 2  # the first stage has two layers with weights
    for stage in fit["plan"]["stages"]:
        grads = _stage_bytes(tuple(stage["layers"]), 8)
        held = [ranks[rank] for rank in stage["devices"]]
        steps = sum(1 for layer in Classifier().layers[stage["layers"][0] : stage["layers"][1]] for _ in layer.parameters())
        assert sum(r["state_bytes"] for r in held) == 2 * grads + steps * torch.empty((), dtype=torch.float32).element_size()
        assert all(r["state_bytes"] < 2 * grads for r in held)
        for step in range(3):
            at_step = [r["grad_bytes"][step] for r in held]
            if fit["zero"] == 2:
                assert sum(at_step) == grads and max(at_step) < grads, (stage, at_step)
            else:
                assert at_step == [grads] * len(held)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", [1, 2])
def test_fp16_mixed_precision_with_clipping_matches_the_unsharded_replicas(zero: int, root: Path) -> None:
    """16-mixed (float32 weights, a GradScaler; there are no master copies to shard): the
    GradScaler unscales the optimizer's parameters, the owner's share, and clipping counts
    each parameter on its owner, so the result is the unsharded strategy's; both are near
    one process with the same precision (the replicas' half-batch products round apart)."""
    _, sharded = _fit(f"dp_z{zero}_fp16", root)
    _, whole = _fit("dp_z0_fp16", root)
    assert _gap(sharded[0]["checkpoint"], whole[0]["checkpoint"]) < 1e-5
    plain = _plain(root, "16-mixed")
    assert _gap(whole[0]["checkpoint"], plain) < 1e-2
    scales = [{k: v for k, v in ranks[0]["checkpoint"].items() if k.endswith("MixedPrecision")} for ranks in (sharded, whole)]
    assert scales[0] == scales[1] and scales[0]  # the same loss scale
