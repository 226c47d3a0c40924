"""Regenerate the chunked-schedule examples of ``docs/actions.md``: interleaved 1F1B and ZB-V.

Four device groups of one device each, M = 8, a uniform model of 8 layers (F = 1, I = W = 1
per layer, so every chunk of one layer costs the same and nothing is transferred): interleaved
1F1B with 2 chunks per group (stage k on group k mod 4) and ZB-V (stage k on group k, then
back up: 0 1 2 3 3 2 1 0). For each, the per-group merged orders the executor runs
(``simulate.plan_and_schedule.schedule_for_plan``, ``Schedule.orders``) are printed in the text form of
``schedule.actions.format_actions``, and the simulated step is drawn with
``simulate.timeline_png.draw_timeline``.

    .venv/bin/python docs/make_chunked_figures.py [--out-dir docs]
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

GROUPS, MICRO_BATCHES = 4, 8
PLACEMENTS = {
    "interleaved": [k % GROUPS for k in range(2 * GROUPS)],
    "zbv": [k if k < GROUPS else 2 * GROUPS - 1 - k for k in range(2 * GROUPS)],
}
PICTURES = {"interleaved": "actions_interleaved_4x2.png", "zbv": "actions_zbv_4.png"}


def example_profile() -> ModelProfile:
    layers = tuple(
        LayerProfile(f"layer{i}", forward_ms=1.0, backward_ms=2.0, output_bytes=0.0, param_bytes=1024.0, stash_bytes=1024.0, backward_input_ms=1.0, backward_weight_ms=1.0)
        for i in range(2 * GROUPS)
    )
    return ModelProfile(micro_batch_size=1, layers=layers, name="uniform")


def example_plan(schedule: str) -> Plan:
    stages = tuple(StagePlan((k, k + 1), (group,)) for k, group in enumerate(PLACEMENTS[schedule]))
    return Plan(global_batch_size=MICRO_BATCHES, micro_batches=MICRO_BATCHES, stages=stages, schedule=schedule)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent, help="where to write the PNGs")
    args = parser.parse_args(argv)
    profile, cluster = example_profile(), Cluster(1, GROUPS, name="example")
    for name, picture in PICTURES.items():
        plan = example_plan(name)
        schedule = schedule_for_plan(plan, profile)
        print(f"# {name}, P={GROUPS}, {plan.chunks} chunks per group, M={MICRO_BATCHES}, placement={list(schedule.placement)}, K per group={[schedule.warmups[schedule.placement.index(g)] for g in range(GROUPS)]}")
        print("# compute only, one line per device group")
        print(format_actions(schedule.orders, compute_only=True))
        print("# full merged order of device group 3")
        print(format_actions(schedule.orders[3:]))
        result = simulate_plan(plan, profile, cluster)
        title = f"{name}: P={GROUPS}, M={MICRO_BATCHES}, {plan.chunks} chunks per group; latency {result.latency_ms:.1f} ms, bubble {100 * result.bubble_fraction:.1f}%"
        print(f"wrote {draw_timeline(result, args.out_dir / picture, title)}", file=sys.stderr)


if __name__ == "__main__":
    main()
