"""Planner benchmark: DAPPLE vs PipeDream vs DP vs straight on the paper's models (Table 4),
and the planner's running time.

    python benchmarks/bench_planner.py                 # everything (a few minutes on 2 cores)
    python benchmarks/bench_planner.py --skip-timing   # only the table
    python benchmarks/bench_planner.py --out benchmarks/results/planner.json

(a) For paper-a/b/c and each Table 4 model with a profile in shared/profiles/dapple/ (VGG-19
GBS 2048, GNMT-16 GBS 1024, BERT-48 GBS 64, XLNet-36 GBS 128, AmoebaNet-36 GBS 128) plan with
DAPPLE (``plan_dapple``) and PipeDream (``plan_pipedream``), build the best DP and straight
plans under the same cost model (``data_parallel_candidates``/``straight_candidates``),
simulate all four (``simulate_plan``) and print one row per model and cluster, with the
paper's Table 4 plan beside ours. A row is flagged when DAPPLE simulates slower than one
of the others; the script exits 1 if any row is flagged.

(b) Planner time: BERT-48 on paper-a (budget 0.5 s) and a 128-layer synthetic model on 8x8
(64 devices, budget 2 s), medians of 3 runs, wall clock and CPU time (the development
machine's two cores are shared, so CPU time is the steadier number).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.dapple_planner import data_parallel_candidates, straight_candidates
from lightning_dapple.plan.plan import Plan
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.profile.model_profile import LayerProfile, ModelProfile
from lightning_dapple.simulate import simulate_plan
from lightning_dapple.simulate.plan_and_schedule import make_plan

PROFILES = Path(__file__).resolve().parents[1].parent / "shared" / "profiles" / "dapple"

# model, profile file, global batch (Table 4)
MODELS = [
    ("VGG-19", "vgg-19-pbs-32.txt", 2048),
    ("GNMT-16", "gnmt-16-pbs-64.txt", 1024),
    ("BERT-48", "bert-48-pbs-2.txt", 64),
    ("XLNet-36", "xlnet-36-pbs-1.txt", 128),
    ("AmoebaNet-36", "amoeba-36-pbs-1.txt", 128),
]
CLUSTERS = ["paper-a", "paper-b", "paper-c"]

# DAPPLE Table 4: plan (split position)
TABLE4 = {
    ("VGG-19", "paper-a"): "DP",
    ("VGG-19", "paper-b"): "DP",
    ("VGG-19", "paper-c"): "15:1 (13:6)",
    ("GNMT-16", "paper-a"): "8:8 (9:7)",
    ("GNMT-16", "paper-b"): "8:8 (9:7)",
    ("GNMT-16", "paper-c"): "straight",
    ("BERT-48", "paper-a"): "8:8 (23:25)",
    ("BERT-48", "paper-b"): "straight",
    ("BERT-48", "paper-c"): "straight",
    ("XLNet-36", "paper-a"): "8:8 (18:18)",
    ("XLNet-36", "paper-b"): "8:8 (18:18)",
    ("XLNet-36", "paper-c"): "straight",
    ("AmoebaNet-36", "paper-a"): "8:8 (24:12)",
    ("AmoebaNet-36", "paper-b"): "11:5 (27:9)",
    ("AmoebaNet-36", "paper-c"): "11:5 (27:9)",
}


def _plan_of(item: Any, gbs: int) -> Plan:
    return Plan(global_batch_size=gbs, micro_batches=item.micro_batches, stages=item.stages)


def _describe(plan: Plan) -> str:
    kind = plan.kind()
    if kind in ("DP", "single"):
        return kind
    split = ":".join(str(s.end - s.start) for s in plan.stages)
    return f"{kind} ({split})" if len(plan.stages) <= 4 else f"{kind}, {len(plan.stages)} stages"


def compare(model: str, filename: str, gbs: int, cluster_name: str) -> dict[str, Any]:
    """Plan one model on one cluster four ways and simulate each."""
    profile = load_profile(PROFILES / filename)
    cluster = load_cluster(cluster_name)
    row: dict[str, Any] = {"model": model, "cluster": cluster_name, "gbs": gbs, "paper": TABLE4.get((model, cluster_name), "-")}
    start = time.perf_counter()
    dapple = make_plan(profile, cluster, gbs)
    row["dapple_s"] = time.perf_counter() - start
    row["dapple_plan"] = _describe(dapple)
    row["dapple_m"] = dapple.micro_batches
    row["dapple"] = dapple.predicted.simulated_latency_ms if dapple.predicted else None
    row["dapple_formula"] = dapple.predicted.latency_ms if dapple.predicted else None
    row["reason"] = dapple.reason
    row["pipedream_slice"] = row["dapple_same_floor"] = None
    try:
        pipedream = make_plan(profile, cluster, gbs, planner="pipedream")
        row["pipedream"] = pipedream.predicted.simulated_latency_ms
        row["pipedream_plan"] = _describe(pipedream)
        row["pipedream_slice"] = _smallest_slice(pipedream)
    except DappleConfigError as exc:
        row["pipedream"], row["pipedream_plan"] = None, f"none ({exc.problem[:40]})"
    if row["pipedream_slice"] is not None and row["pipedream_slice"] < profile.micro_batch_size:
        # PipeDream's minibatch is the profile's batch per worker, and a replicated stage
        # slices it: its devices run fewer samples than were profiled, which DAPPLE's slice
        # floor refuses. Compare it with DAPPLE planning at the same floor.
        same_floor = make_plan(profile, cluster, gbs, min_slice=row["pipedream_slice"])
        row["dapple_same_floor"] = same_floor.predicted.simulated_latency_ms
    dp = [item for item in data_parallel_candidates(PlanRequest.build(profile, cluster, gbs)) if item.fits(cluster)]
    row["dp"] = simulate_plan(_plan_of(dp[0], gbs), profile, cluster).latency_ms if dp else None
    straight = straight_candidates(PlanRequest.build(profile, cluster, gbs))
    row["straight"] = simulate_plan(_plan_of(straight[0], gbs), profile, cluster).latency_ms if straight else None
    others = [row[k] for k in ("dp", "straight") if row[k] is not None]
    same_floor = row["dapple"] if row["dapple_same_floor"] is None else row["dapple_same_floor"]
    pipedream_ok = row["pipedream"] is None or same_floor <= row["pipedream"] * (1 + 1e-9)
    row["ok"] = row["dapple"] is not None and pipedream_ok and all(row["dapple"] <= other * (1 + 1e-9) for other in others)
    return row


def _smallest_slice(plan: Plan) -> int:
    """The fewest samples one device runs per micro-batch under ``plan``."""
    return min(plan.micro_batch_size // stage.replicas for stage in plan.stages)


def _pipedream_cell(row: dict[str, Any]) -> str:
    """PipeDream's latency; with its slices below the profiled batch, that slice and DAPPLE's latency at the same floor."""
    if row["dapple_same_floor"] is None:
        return _ms(row["pipedream"])
    return f"{_ms(row['pipedream'])} (slice {row['pipedream_slice']}; DAPPLE {_ms(row['dapple_same_floor'])})"


def synthetic_profile(layers: int = 128, seed: int = 0) -> ModelProfile:
    """A deterministic non-uniform chain: the timing benchmark's 128-layer model."""
    rng = random.Random(seed)
    out = []
    for i in range(layers):
        f = rng.uniform(1.0, 4.0)
        out.append(LayerProfile(f"layer{i}", f, 2 * f, rng.uniform(1e6, 8e6), rng.uniform(5e6, 3e7), rng.uniform(5e6, 2e7)))
    return ModelProfile(4, tuple(out), name=f"synthetic-{layers}")


def timing(repeats: int = 3) -> list[dict[str, Any]]:
    """Median wall and CPU time of plan_dapple on the two reference instances."""
    cases = [
        ("BERT-48 on paper-a", load_profile(PROFILES / "bert-48-pbs-2.txt"), load_cluster("paper-a"), 64, 0.5),
        ("128-layer synthetic on 8x8", synthetic_profile(), load_cluster("8x8"), 512, 2.0),
    ]
    results = []
    for name, profile, cluster, gbs, budget in cases:
        wall, cpu = [], []
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(profile, cluster, gbs)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        results.append(
            {
                "case": name,
                "budget_s": budget,
                "wall_s": statistics.median(wall),
                "cpu_s": statistics.median(cpu),
                "plan": _describe(plan),
                "latency_ms": plan.predicted.latency_ms if plan.predicted else None,
            }
        )
    return results


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows and timings as JSON")
    args = parser.parse_args(argv)
    console = make_console()
    rows: list[dict[str, Any]] = []
    if not args.skip_table:
        table = Table(title="Simulated step latency (ms): DAPPLE vs PipeDream vs DP vs straight (16 devices)")
        for header in ("model (GBS)", "cluster", "DAPPLE plan", "M", "DAPPLE", "PipeDream", "DP", "straight", "paper Table 4", "plan s", ""):
            table.add_column(header)
        for model, filename, gbs in MODELS:
            if not (PROFILES / filename).is_file():
                continue
            for cluster_name in CLUSTERS:
                try:
                    row = compare(model, filename, gbs, cluster_name)
                except DappleConfigError as exc:
                    console.print(f"{model} on {cluster_name}: {exc}")
                    continue
                rows.append(row)
                table.add_row(
                    f"{model} ({gbs})",
                    cluster_name,
                    row["dapple_plan"],
                    str(row["dapple_m"]),
                    _ms(row["dapple"]),
                    _pipedream_cell(row),
                    _ms(row["dp"]),
                    _ms(row["straight"]),
                    row["paper"],
                    f"{row['dapple_s']:.2f}",
                    "" if row["ok"] else "[red]DAPPLE slower[/red]",
                )
        console.print(table)
    timings: list[dict[str, Any]] = []
    if not args.skip_timing:
        timings = timing(args.repeats)
        for item in timings:
            flag = "" if item["wall_s"] <= item["budget_s"] else "  (over budget)"
            console.print(
                f"plan_dapple, {item['case']}: median {item['wall_s']:.2f} s wall, {item['cpu_s']:.2f} s CPU "
                f"(budget {item['budget_s']:g} s){flag}; {item['plan']}, formula {item['latency_ms']:.1f} ms"
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "timings": timings}, indent=2) + "\n")
    flagged = [row for row in rows if not row["ok"]]
    if flagged:
        console.print(f"[red]{len(flagged)} row(s) where DAPPLE simulates slower than a baseline[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
