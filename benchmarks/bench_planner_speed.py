"""Planning speed: BERT-48 on paper-a and a 128-layer model on 64 devices (8x8).

    .venv/bin/python benchmarks/bench_planner_speed.py [--repeats 3] [--out benchmarks/results/planner_speed.json]

(a) In-process: wall and CPU time of ``make_plan`` (the planner with its simulated
re-ranking, what ``dapple-plan`` runs) after the imports, median of
``--repeats`` runs (the first run, which also pays lazy imports, reported apart).
(b) The CLI: wall time of ``dapple-plan --json`` for BERT-48 on paper-a in a fresh process,
and of the same process doing only the imports the CLI needs ("start-up"), run in turn;
the planning cost beyond start-up is the median of their differences. Targets: BERT-48
under 0.5 s beyond start-up, 128 layers x 64 devices under 2 s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BERT = ROOT.parent / "shared" / "profiles" / "dapple" / "bert-48-pbs-2.txt"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # time this checkout's package, installed or not


def in_process(repeats: int) -> list[dict[str, Any]]:
    from bench_planner import synthetic_profile

    from lightning_dapple.cluster import load_cluster
    from lightning_dapple.profile.loader import load_profile
    from lightning_dapple.simulate.plan_and_schedule import make_plan

    cases = [
        ("BERT-48 on paper-a", load_profile(BERT), load_cluster("paper-a"), 64, 0.5),
        ("128 layers on 8x8 (64 devices)", synthetic_profile(), load_cluster("8x8"), 512, 2.0),
    ]
    rows = []
    for name, profile, cluster, gbs, target in cases:
        wall, cpu = [], []
        for _ in range(repeats + 1):
            w0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(profile, cluster, gbs)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        rows.append({"case": name, "target_s": target, "first_wall_s": wall[0], "wall_s": statistics.median(wall[1:]),
                     "cpu_s": statistics.median(cpu[1:]), "plan": plan.kind(), "micro_batches": plan.micro_batches})
    return rows


def _wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def cli(repeats: int) -> dict[str, Any]:
    plan = [sys.executable, "-m", "lightning_dapple.cli.plan", "--profile", str(BERT), "--cluster", "paper-a", "--global-batch-size", "64", "--json"]
    imports = "import lightning_dapple.cli.plan"  # everything dapple-plan imports before it plans
    startup = [sys.executable, "-c", imports]
    # alternate the two so that a drift of the machine's speed hits both alike, and take the
    # median of each pair's difference
    _wall(plan), _wall(startup)  # untimed: warms the file cache for both
    totals, bases = [], []
    for _ in range(repeats):
        totals.append(_wall(plan))
        bases.append(_wall(startup))
    beyond = statistics.median(total - base for total, base in zip(totals, bases))
    return {"cli_wall_s": statistics.median(totals), "startup_wall_s": statistics.median(bases), "beyond_startup_s": beyond, "target_s": 0.5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = {"in_process": in_process(args.repeats), "cli": cli(args.repeats)}
    for row in result["in_process"]:
        print(f"{row['case']}: wall {row['wall_s']:.2f} s, CPU {row['cpu_s']:.2f} s (first {row['first_wall_s']:.2f} s), target {row['target_s']} s -> {row['plan']}")
    c = result["cli"]
    print(f"dapple-plan BERT-48 paper-a: {c['cli_wall_s']:.2f} s, start-up {c['startup_wall_s']:.2f} s, beyond start-up {c['beyond_startup_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
