"""Does ``plan="auto"`` choose well? Each tiny recipe's automatic plan against data parallelism.

The planner prices each stage's optimizer step (``LayerProfile.optimizer_ms``, the run's
own optimizer timed per layer at set-up) and the run's own AllReduce and transfer costs
(``execute/collective_probe.py``). Both move plans away from data parallelism on CPU
processes: DP repeats the whole model's optimizer step on every process, and a gloo
AllReduce over 4 processes sharing 2 cores costs milliseconds per call. This measures
whether the plans it then chooses run at least as fast as DP, on 4 CPU processes
(``_measured_steps.train``):

1. ``dapple-train recipe=NAME`` as users run it (``plan="auto"``): the plan it chose;
2. per round, that plan file and the DP shape (``benchmarks/plans/dp_4.json``: one stage on
   all 4 processes, M chosen by the planner), one right after the other, in alternating
   order.

The verdict per recipe is the median over rounds of chosen / DP (step times after the
warm-up steps, slowest rank per step); a recipe whose automatic plan is DP has nothing to
compare and is reported as such. Target: at most 1.03.

    python benchmarks/bench_plan_choice.py --rounds 2 --out benchmarks/results/plan_choice.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _measured_steps  # noqa: E402  (beside this script)

TARGET = 1.03
DP_SHAPE = HERE / "plans" / "dp_4.json"


def recipe_choice(recipe: str, work: Path, steps: int, rounds: int) -> dict[str, Any]:
    """Runs 1-2 of the module docstring for one recipe."""
    auto = _measured_steps.train(recipe, work / f"{recipe}-auto", steps)
    row: dict[str, Any] = {key: auto[key] for key in ("recipe", "plan", "micro_batches", "measured_ms", "simulated_ms")}
    if auto["plan"] == "DP":
        return {**row, "ratio": None, "ratios": [], "chosen_ms": auto["measured_ms"], "dp_ms": auto["measured_ms"]}
    plan_file = Path(auto["run_dir"]) / "dapple_plan.json"
    variants = {"chosen": (f"strategy.plan={plan_file}",), "dp": (f"strategy.plan={DP_SHAPE}",)}
    pairs = []
    for index in range(rounds):
        order = ("chosen", "dp") if index % 2 == 0 else ("dp", "chosen")
        runs = {label: _measured_steps.train(recipe, work / f"{recipe}-{label}-{index}", steps, variants[label]) for label in order}
        pairs.append(runs)
    dp = pairs[0]["dp"]
    return {
        **row,
        "dp_plan": f"{dp['plan']} M={dp['micro_batches']}",
        "dp_simulated_ms": dp.get("simulated_ms"),
        "chosen_ms": statistics.median(pair["chosen"]["measured_ms"] for pair in pairs),
        "dp_ms": statistics.median(pair["dp"]["measured_ms"] for pair in pairs),
        "ratios": [pair["chosen"]["measured_ms"] / pair["dp"]["measured_ms"] for pair in pairs],
        "ratio": statistics.median(pair["chosen"]["measured_ms"] / pair["dp"]["measured_ms"] for pair in pairs),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| recipe | auto plan | M | simulated ms (auto / DP) | measured ms (auto / DP) | per-round auto / DP | median | within 3 % |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["ratio"] is None:
            print(f"| {row['recipe']} | DP | {row['micro_batches']} | - | {row['chosen_ms']:.1f} | - | - | (DP chosen) |")
            continue
        simulated = f"{row['simulated_ms']:.1f} / {row['dp_simulated_ms']:.1f}" if row.get("dp_simulated_ms") else "-"
        ratios = ", ".join(f"{ratio:.3f}" for ratio in row["ratios"])
        ok = "yes" if row["ratio"] <= TARGET else "NO"
        print(
            f"| {row['recipe']} | {row['plan']} | {row['micro_batches']} | {simulated} | {row['chosen_ms']:.1f} / {row['dp_ms']:.1f} | "
            f"{ratios} | {row['ratio']:.3f} | {ok} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["bert_tiny", "gnmt_tiny", "vgg_tiny"])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (the first few are warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs per recipe")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plan_choice_") as tmp:
        rows = [recipe_choice(recipe, Path(tmp), args.steps, args.rounds) for recipe in args.recipes]
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(row["ratio"] is None or row["ratio"] <= TARGET for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
