"""Today's planner against a frozen record of the planner's plans on every shared profile
(tests/data/planner_before.json, written by tests/data/make_planner_before.py from the
planner before the AllReduce overlap and the in-place stash estimate).

Plans may differ only where those changes reach them on purpose:

* the overlapped gradient AllReduce prices every replicated stage differently, so a plan
  with a replicated stage (before or now) may change -- but today's choice must not
  simulate slower, under today's model, than the recorded plan;
* graph-text profiles with in-place operators stash less, so their plans may change the
  same way.

Where neither reaches (both plans unreplicated, profile without in-place nodes) the plan
must be the recorded one. The PipeDream baseline was replaced by PipeDream's own optimizer
and is not compared.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_dapple.cluster import load_cluster
from lightning_dapple.plan.dapple_planner import plan_dapple
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import load_profile
from lightning_dapple.simulate import simulate_plan

DATA = Path(__file__).with_name("data") / "planner_before.json"
PROFILES = Path(__file__).resolve().parents[1].parent / "shared" / "profiles"
pytestmark = pytest.mark.skipif(not PROFILES.is_dir() or not DATA.is_file(), reason="needs ../shared/profiles")


def _rows() -> list[dict[str, Any]]:
    return [row for row in json.loads(DATA.read_text()) if "dapple" in row and "error" not in row["dapple"]] if DATA.is_file() else []


def _stages(raw: list) -> tuple[StagePlan, ...]:
    return tuple(StagePlan((a, b), tuple(devices)) for a, b, devices in raw)


def _replicated(stages: tuple[StagePlan, ...]) -> bool:
    return any(stage.replicas > 1 for stage in stages)


@pytest.mark.timeout(1800)
def test_plans_match_the_record_except_where_changed_on_purpose() -> None:
    rows = _rows()
    assert len(rows) >= 60
    profiles: dict[str, Any] = {}
    changed = []
    for row in rows:
        profile = profiles.get(row["profile"]) or profiles.setdefault(
            row["profile"], load_profile(PROFILES / row["profile"], profile_batch_size=row["pbs"])
        )
        cluster = load_cluster(row["cluster"])
        plan = plan_dapple(profile, cluster, row["gbs"])
        old = _stages(row["dapple"]["stages"])
        if plan.stages == old and plan.micro_batches == row["dapple"]["micro_batches"]:
            continue
        inplace = any(layer.stash_bytes == 0 and layer.param_bytes == 0 and layer.forward_ms > 0 for layer in profile.layers)
        where = f"{row['profile']} on {row['cluster']}"
        assert _replicated(plan.stages) or _replicated(old) or inplace, f"{where}: unreplicated plan changed"
        before = simulate_plan(Plan(row["gbs"], row["dapple"]["micro_batches"], old), profile, cluster).latency_ms
        assert plan.predicted.simulated_latency_ms <= before * (1 + 1e-9), f"{where}: {plan.kind()} slower than the recorded {row['dapple']['kind']}"
        changed.append(f"{where}: {row['dapple']['kind']} -> {plan.kind()} ({before:.0f} -> {plan.predicted.simulated_latency_ms:.0f} ms)")
    print("\nchanged on purpose:\n" + "\n".join(changed))
