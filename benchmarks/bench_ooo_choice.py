"""Does ``ooo="auto"`` choose well? Each tiny recipe measured with out-of-order backprop on and off.

For each recipe (default: bert_tiny, gnmt_tiny, vgg_tiny, bert_pipeline_tiny) on 4 CPU
processes (``_measured_steps.train``):

1. ``dapple-train recipe=NAME`` as users run it (``plan="auto"``, ``ooo="auto"``): the plan,
   what ``ooo="auto"`` chose and why (the simulated steps with and without, the executor's
   overhead per action priced, ``profile/action_overhead.py``), and its measured step;
2. the same plan file with the other choice forced (``strategy.plan=<run 1's plan>
   strategy.ooo=...``), measured;
3. the same plan file with the chosen setting again, so that the two settings compared were
   both run from a plan file, one right after the other.

The verdict per recipe is chosen / other of the medians of runs 2 and 3 (step times after
the warm-up steps, slowest rank per step); the target is at most 1.03. Pairs run one after
another on the same machine; on a loaded machine single runs swing by more than 3 %, so
``--rounds`` repeats runs 2-3 and the ratio is the median over rounds.

    python benchmarks/bench_ooo_choice.py                       # 4 recipes, 60 steps, 1 round
    python benchmarks/bench_ooo_choice.py --recipes vgg_tiny --rounds 3 --out /tmp/ooo_choice.json
    python benchmarks/bench_ooo_choice.py --recipes vgg_tiny --rounds 3 --overrides strategy.plan=benchmarks/plans/straight_4x1_m8.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _measured_steps  # noqa: E402  (beside this script)

TARGET = 1.03


def recipe_choice(recipe: str, work: Path, steps: int, rounds: int, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Runs 1-3 of the module docstring for one recipe; ``overrides`` go to run 1 (e.g. a
    plan shape file: ``strategy.plan=benchmarks/plans/straight_4x1_m8.json``)."""
    auto = _measured_steps.train(recipe, work / f"{recipe}-auto", steps, overrides)
    plan_file = Path(auto["run_dir"]) / "dapple_plan.json"
    chosen, other = auto["ooo"], not auto["ooo"]
    pairs = []
    for index in range(rounds):
        runs = {}
        for label, setting in (("other", other), ("chosen", chosen)):
            overrides = (f"strategy.plan={plan_file}", f"strategy.ooo={str(setting).lower()}")
            runs[label] = _measured_steps.train(recipe, work / f"{recipe}-{label}-{index}", steps, overrides)["measured_ms"]
        pairs.append(runs)
    ratios = [pair["chosen"] / pair["other"] for pair in pairs]
    return {
        **{key: auto[key] for key in ("recipe", "plan", "micro_batches", "ooo_choice", "measured_ms", "simulated_ms", "action_overhead_ms")},
        "chosen": "on" if chosen else "off",
        "chosen_ms": statistics.median(pair["chosen"] for pair in pairs),
        "other_ms": statistics.median(pair["other"] for pair in pairs),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| recipe | plan | M | auto chose | chosen ms | other ms | chosen / other | within 3 % | why |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ok = "yes" if row["ratio"] <= TARGET else "NO"
        print(
            f"| {row['recipe']} | {row['plan']} | {row['micro_batches']} | {row['chosen']} | {row['chosen_ms']:.1f} | "
            f"{row['other_ms']:.1f} | {row['ratio']:.3f} | {ok} | {row['ooo_choice']} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(_measured_steps.TINY_RECIPES))
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (the first few are warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of forced runs per recipe")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides for each recipe's own run (run 1), e.g. strategy.plan=SHAPE.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ooo_choice_") as tmp:
        rows = [recipe_choice(recipe, Path(tmp), args.steps, args.rounds, tuple(args.overrides)) for recipe in args.recipes]
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(row["ratio"] <= TARGET for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
