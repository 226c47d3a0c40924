"""One entry point to the planners: ``make_plan(profile, cluster, global_batch_size, planner=...)``.

``dapple`` is DAPPLE's planner (section 4); ``pipedream`` is PipeDream's partitioner (3.2),
the baseline, priced and scheduled the same way so the two can be compared.
"""
from __future__ import annotations

from typing import Any

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import require
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.model_profile import ModelProfile

PLANNERS = ("dapple", "pipedream")


def make_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int, planner: str = "dapple", **kwargs: Any) -> Plan:
    """Plan ``profile`` for ``cluster`` and a global batch; kwargs go to the planner
    (micro_batches, schedule, policy, num_devices, min_slice)."""
    require(planner in PLANNERS, "planner", f"is {planner!r}", f"use one of {list(PLANNERS)}")
    if planner == "pipedream":
        from lightning_dapple.plan.pipedream_planner import plan_pipedream

        return plan_pipedream(profile, cluster, global_batch_size, **kwargs)
    from lightning_dapple.plan.dapple_planner import plan_dapple

    return plan_dapple(profile, cluster, global_batch_size, **kwargs)
