"""What the planner does with ZeRO: a model that needs it, and Table 4 searched again with it.

1. A model whose optimizer state decides the plan: eight equal blocks of 0.5 GiB of fp32
   weights (16 GiB with gradients and Adam's two moments), 10/20 ms forward/backward per
   block at the profile's micro-batch of 4, global batch 64, on 4 devices of 8 GiB
   (NVLink-class links). It is planned with every replica keeping its whole optimizer state
   (``zero=0``, the paper's memory model), with ZeRO-1 on every replicated stage
   (``zero=1``) and with the choice left to the planner (``zero="auto"``): each plan's shape,
   cut, M, per-stage levels, peak memory per device and simulated step (``simulate_plan``).
2. With the published profiles (``$DAPPLE_SHARED_PROFILES``), every cell of DAPPLE's Table 4
   planned without ZeRO and with ``zero="auto"`` (``app/table4.py --zero``), and how many
   cells change plan or simulated step.

    python benchmarks/bench_table4_zero.py      # prints Markdown, writes benchmarks/results/table4_zero.json
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lightning_dapple.app.recipe_profile import shared_profiles_dir
from lightning_dapple.app.table4 import zero_changed, zero_markdown, zero_rows
from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan

HERE = Path(__file__).resolve().parent
CLUSTER = Cluster(1, 4, intra_bandwidth_gbps=2400.0, inter_bandwidth_gbps=100.0, device_memory_gib=8.0, name="4x8GiB")
GLOBAL_BATCH = 64


def heavy_model() -> ModelProfile:
    """Eight equal blocks, 0.5 GiB of weights each (part 1 of the module docstring)."""
    layers = tuple(
        LayerProfile(f"block{i}", forward_ms=10.0, backward_ms=20.0, output_bytes=4e6, param_bytes=0.5 * GIB, stash_bytes=0.05 * GIB, optimizer_ms=2.0)
        for i in range(8)
    )
    return ModelProfile(micro_batch_size=4, layers=layers, name="heavy-8x0.5GiB")


def heavy_rows() -> list[dict[str, Any]]:
    """The model's plan under each setting of ``zero``."""
    profile = heavy_model()
    rows = []
    for zero in (0, 1, "auto"):
        plan = make_plan(profile, CLUSTER, GLOBAL_BATCH, schedule="dapple", zero=zero)
        rows.append({
            "zero": zero, "kind": plan.kind(), "split": ":".join(str(s.end - s.start) for s in plan.stages), "micro_batches": plan.micro_batches,
            "levels": [s.zero for s in plan.stages], "peak_gib": max(plan.predicted.memory_bytes) / GIB,
            "simulated_ms": simulate_plan(plan, profile, CLUSTER).latency_ms, "reason": plan.reason,
        })
    return rows


def heavy_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| zero | plan (layers per stage, M) | levels | peak per device | simulated step |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| `{row['zero']}` | {row['kind']} ({row['split']}, M={row['micro_batches']}) | {row['levels']} | {row['peak_gib']:.2f} GiB | "
            f"{row['simulated_ms']:.1f} ms |"
        )
    lines.append("")
    lines.append(f"why (zero=\"auto\"): {rows[-1]['reason']}")
    return "\n".join(lines)


def main() -> None:
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    heavy = heavy_rows()
    print(f"# {started}\n\n{heavy_markdown(heavy)}\n")
    out: dict[str, Any] = {"date": started, "heavy": heavy}
    if shared_profiles_dir() is None:
        print("Table 4: the published profiles are not here ($DAPPLE_SHARED_PROFILES); skipped.")
    else:
        rows = zero_rows()
        print(zero_markdown(rows))
        out["table4"] = rows
        out["table4_changed"] = sum(zero_changed(row) for row in rows)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "table4_zero.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
