"""Simulated bubble of each schedule beside its paper's closed form.

Two settings, P = 4 device groups, M = 8 micro-batches (``--micro-batches``):

* ``unit``: a uniform model in which one whole stage costs F = B_input = W = 1 (so B = 2),
  free transfers. Here the closed forms are exact and the simulator must meet them.
* ``bert48``: BERT-48 (``shared/profiles/dapple/bert-48-pbs-2.txt``, micro-batch 2) on 4
  devices of one paper-a server (NVLink; DAPPLE Table 2, config A), one device per group,
  global batch 2M. The layers are cut into 4 stages (8 for the chunked schedules) of equal
  F + B; the B/W split is the estimate of ``plan.options.with_weight_split``.

Schedules: GPipe, DAPPLE early backward (1F1B, P_A), DAPPLE with out-of-order backprop
(ZB-H1-like), interleaved 1F1B with v = 2 chunks per group, and ZB-V (2 chunks per group
in a V). Closed forms, as fractions of the step's device time (idle / (idle + compute)),
with F, B, W the mean costs of one group's whole share of the model (both chunks):

* GPipe and 1F1B: (P-1) / (M+P-1) (gpipe.txt sec. 2; DAPPLE 3.2);
* 1F1B with deferred W (ZB-H1, Qi et al. 2024 sec. 3): idle (P-1)(F+I-W) per device,
  with I = B - W the input-gradient part of the backward (1F1B's is (P-1)(F+I+W));
* interleaved 1F1B: idle (P-1)(F+B)/v (Narayanan et al. 2021, sec. 2.2.2), so
  (P-1) / (vM + P-1);
* ZB-V: idle (P-1) F/2 per device: the last group cannot start before the first
  micro-batch has crossed P-1 chunk forwards (F/2 each); at F = I = W ZB-V fills every
  other slot (``schedule/zbv.py``), so this is its bubble there. With unequal F, I and W
  (BERT-48's estimated split) it is the ideal, not a bound.

    python benchmarks/bench_bubbles.py              # markdown table on stdout
    python benchmarks/bench_bubbles.py --json benchmarks/results/bubbles.json
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from lightning_dapple.cluster import Cluster, load_cluster
from lightning_dapple.plan.costs import stage_costs
from lightning_dapple.plan.options import with_weight_split
from lightning_dapple.plan.plan import Plan, StagePlan
from lightning_dapple.profile import load_profile
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate.plan_and_schedule import simulate_plan

GROUPS = 4
PROFILES = Path(__file__).resolve().parents[2] / "shared" / "profiles"
BERT48 = "dapple/bert-48-pbs-2.txt"
# (row name, plan schedule, stages, ooo, group of stage k)
SCHEDULES: list[tuple[str, str, int, bool, Callable[[int], int]]] = [
    ("gpipe", "gpipe", GROUPS, False, lambda k: k),
    ("dapple (1F1B)", "dapple", GROUPS, False, lambda k: k),
    ("dapple + ooo", "dapple", GROUPS, True, lambda k: k),
    ("interleaved v=2", "interleaved", 2 * GROUPS, False, lambda k: k % GROUPS),
    ("zbv", "zbv", 2 * GROUPS, False, lambda k: k if k < GROUPS else 2 * GROUPS - 1 - k),
]


def balanced_cuts(profile: ModelProfile, parts: int) -> list[int]:
    """Layer boundaries of ``parts`` consecutive stages of about equal F + B."""
    weights = [layer.forward_ms + layer.backward_ms for layer in profile.layers]
    total, bounds, running = sum(weights), [0], 0.0
    for index, weight in enumerate(weights[:-1]):
        running += weight
        if len(bounds) < parts and running >= total * len(bounds) / parts:
            bounds.append(index + 1)
    return bounds + [len(weights)]


def make_plan(profile: ModelProfile, micro_batches: int, schedule: str, parts: int, ooo: bool, group: Callable[[int], int]) -> Plan:
    bounds = balanced_cuts(profile, parts)
    stages = tuple(StagePlan((bounds[k], bounds[k + 1]), (group(k),)) for k in range(parts))
    return Plan(global_batch_size=micro_batches * profile.micro_batch_size, micro_batches=micro_batches, stages=stages, schedule=schedule, ooo=ooo)


def closed_form(name: str, f: float, b: float, w: float, micro_batches: int) -> float:
    """The schedule's bubble fraction from its paper (module docstring); b is the full backward."""
    p, m = GROUPS, micro_batches
    compute = m * (f + b)
    idle = {
        "gpipe": (p - 1) * (f + b),
        "dapple (1F1B)": (p - 1) * (f + b),
        "dapple + ooo": (p - 1) * (f + (b - w) - w),
        "interleaved v=2": (p - 1) * (f + b) / 2,
        "zbv": (p - 1) * f / 2,
    }[name]
    return idle / (idle + compute)


def unit_profile() -> ModelProfile:
    """8 layers, two per whole stage: F = B_input = W = 1 per stage (0.5 per layer)."""
    layer = LayerProfile("l", forward_ms=0.5, backward_ms=1.0, output_bytes=0.0, param_bytes=1.0, stash_bytes=1.0, backward_input_ms=0.5, backward_weight_ms=0.5)
    return ModelProfile(micro_batch_size=1, layers=tuple(replace(layer, name=f"l{i}") for i in range(8)), name="unit")


def rows(profile: ModelProfile, cluster: Cluster, micro_batches: int) -> list[dict[str, Any]]:
    out = []
    split = with_weight_split(profile)
    whole = stage_costs(split, cluster, make_plan(split, micro_batches, "dapple", GROUPS, False, lambda k: k).stages, profile.micro_batch_size)
    f = sum(c.forward_ms for c in whole) / GROUPS
    b = sum(c.backward_ms for c in whole) / GROUPS
    w = sum(c.backward_weight_ms for c in whole) / GROUPS
    for name, schedule, parts, ooo, group in SCHEDULES:
        plan = make_plan(profile, micro_batches, schedule, parts, ooo, group)
        result = simulate_plan(plan, profile, cluster)
        out.append(
            {
                "schedule": name,
                "latency_ms": result.latency_ms,
                "bubble": result.bubble_fraction,
                "closed_form": closed_form(name, f, b, w, micro_batches),
                "cuts": [stage.start for stage in plan.stages],
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    m = args.micro_batches
    bert = load_profile(PROFILES / BERT48 if PROFILES.is_dir() else Path("/work/shared/profiles") / BERT48)
    paper_a = replace(load_cluster("paper-a"), machines=1, devices_per_machine=GROUPS, name="paper-a, one server of 4")
    settings = {
        "unit": rows(unit_profile(), Cluster(1, GROUPS, name="unit, nothing to transfer"), m),
        "bert48": rows(bert, paper_a, m),
    }
    print(f"| schedule (P={GROUPS}, M={m}) | unit: simulated | unit: closed form | BERT-48: simulated | BERT-48: closed form | BERT-48 step (ms) |")
    print("|---|---|---|---|---|---|")
    for unit, real in zip(settings["unit"], settings["bert48"]):
        print(
            f"| {unit['schedule']} | {unit['bubble']:.3f} | {unit['closed_form']:.3f} | {real['bubble']:.3f} | "
            f"{real['closed_form']:.3f} | {real['latency_ms']:.1f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"groups": GROUPS, "micro_batches": m, **settings}, indent=2) + "\n")


if __name__ == "__main__":
    main()
