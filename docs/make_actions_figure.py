"""Regenerate the example of ``docs/actions.md``: a 4-stage DAPPLE schedule with out-of-order backprop.

Builds one plan (4 stages, M = 8, stage 0 replicated on two devices so that it ends with the
per-layer W parts and gradient buckets of ooo-backprop Algorithm 2 / DAPPLE 5.2.3), turns it
into the action lists the executor runs (``simulate.plan_and_schedule.schedule_for_plan``), prints them in
the text form of ``schedule.actions.format_actions`` and draws the simulated step with the
simulator's own ``simulate.timeline_png.draw_timeline``.

    .venv/bin/python docs/make_actions_figure.py [--out docs/actions_dapple_ooo_4stage.png]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_dapple.cluster import Cluster
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.schedule.actions import format_actions
from lightning_dapple.simulate.plan_and_schedule import schedule_for_plan, simulate_plan
from lightning_dapple.simulate.timeline_png import draw_timeline

OUT = Path(__file__).with_name("actions_dapple_ooo_4stage.png")
MIB = 2**20


def example_profile() -> ModelProfile:
    """Eight layers, two per stage; stage 0's layers cost twice as much (it runs on two
    devices, each on half of every micro-batch) and hold 30 MiB of parameters each, so that
    every layer is a gradient bucket of its own (``plan.buckets.BUCKET_BYTES`` = 25 MiB)."""
    layers = []
    for index in range(8):
        scale, params = (2.0, 30 * MIB) if index < 2 else (1.0, 4 * MIB)
        layers.append(
            LayerProfile(
                f"layer{index}", forward_ms=scale, backward_ms=2 * scale, output_bytes=64 * 1024, param_bytes=params,
                stash_bytes=MIB, backward_input_ms=scale, backward_weight_ms=scale,
            )
        )
    return ModelProfile(micro_batch_size=4, layers=tuple(layers), name="example", input_bytes=64 * 1024)


def example_plan() -> Plan:
    """DAPPLE early backward (K_i from policy P_A) with out-of-order backprop, M = 8."""
    stages = (
        StagePlan((0, 2), (0, 1)),
        StagePlan((2, 4), (2,)),
        StagePlan((4, 6), (3,)),
        StagePlan((6, 8), (4,)),
    )
    return Plan(global_batch_size=32, micro_batches=8, stages=stages, schedule="dapple", ooo=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the PNG")
    args = parser.parse_args(argv)
    plan, profile, cluster = example_plan(), example_profile(), Cluster(1, 5, name="example")
    schedule = schedule_for_plan(plan, profile)
    print(f"# {schedule.name}, S={schedule.num_stages}, M={schedule.micro_batches}, K={list(schedule.warmups)}")
    print("# compute only")
    print(format_actions(schedule.actions, compute_only=True))
    print("# full action lists")
    print(format_actions(schedule.actions))
    result = simulate_plan(plan, profile, cluster)
    title = (
        f"{schedule.name}: S=4, M=8, stage 0 on two devices; "
        f"latency {result.latency_ms:.2f} ms, bubble {100 * result.bubble_fraction:.1f}%"
    )
    print(f"wrote {draw_timeline(result, args.out, title)}", file=sys.stderr)


if __name__ == "__main__":
    main()
