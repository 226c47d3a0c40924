"""Is the plan ``tune_steps`` keeps ever slower than the simulator's? Each tiny recipe tuned and not.

For each recipe (default: the 4 tiny recipes, the quick start's ``bert_pipeline_tiny`` among
them) on 4 CPU processes (``_measured_steps.train``):

1. ``dapple-train recipe=NAME`` with a fresh profile cache: the simulator's plan, what an
   untuned run executes;
2. ``dapple-train recipe=NAME strategy.tune_steps=N`` on the same cache, so that it plans on
   the same profile (a fresh profile moves a tiny recipe's plan between near-equal cuts):
   the plans measured, each one's simulated and measured trial step, and the plan kept;
3. ``--rounds`` pairs: the kept plan and the simulator's plan, each from its plan file, one
   right after the other (the order alternates between rounds), ``--steps`` steps each.

The verdict per recipe is kept / simulator's, the median over rounds of each round's
ratio of median steps. The target is that it never exceeds 1 + the round-to-round noise,
taken as the larger relative spread (max - min over median) of either plan's steps over
the rounds. Where tuning kept the simulator's plan the ratio is 1 by construction and only
the noise is measured.

    python benchmarks/bench_tuning.py                               # 4 recipes, 60 steps, 3 rounds
    python benchmarks/bench_tuning.py --recipes vgg_tiny --rounds 5 --out /tmp/tuning.json
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

from lightning_dapple.plan.plan import load_plan  # noqa: E402
from lightning_dapple.strategy.tune_candidates import candidate_label  # noqa: E402


def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart one plan's rounds land."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def recipe_tuning(recipe: str, work: Path, steps: int, rounds: int, tune_steps: int) -> dict[str, Any]:
    """Runs 1-3 of the module docstring for one recipe."""
    cache = f"strategy.profile_cache={work / f'{recipe}-cache'}"
    untuned = _measured_steps.train(recipe, work / f"{recipe}-untuned", steps, (cache,))
    tuned = _measured_steps.train(recipe, work / f"{recipe}-tuned", steps, (f"strategy.tune_steps={tune_steps}", cache))
    kept_file, simulator_file = Path(tuned["run_dir"]) / "dapple_plan.json", Path(untuned["run_dir"]) / "dapple_plan.json"
    record = json.loads(kept_file.read_text())["extra"]["tuning"]
    runs: dict[str, list[float]] = {"kept": [], "simulator": []}
    for index in range(rounds):
        order = [("kept", kept_file), ("simulator", simulator_file)]
        for label, plan_file in order if index % 2 == 0 else order[::-1]:
            runs[label].append(_measured_steps.train(recipe, work / f"{recipe}-{label}-{index}", steps, (f"strategy.plan={plan_file}",))["measured_ms"])
    ratios = [kept / simulator for kept, simulator in zip(runs["kept"], runs["simulator"])]
    return {
        "recipe": recipe,
        "kept": record["chosen"],
        "simulator_choice": record["simulator_choice"],
        "untuned": candidate_label(load_plan(simulator_file)),
        "trials": record["candidates"],
        "kept_ms": statistics.median(runs["kept"]),
        "simulator_ms": statistics.median(runs["simulator"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "noise": max(spread(runs["kept"]), spread(runs["simulator"])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(_measured_steps.TINY_RECIPES))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune-steps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for recipe in args.recipes:
            result = recipe_tuning(recipe, Path(scratch), args.steps, args.rounds, args.tune_steps)
            results.append(result)
            source = "the simulator's choice" if result["kept"] == result["simulator_choice"] else f"simulator: {result['simulator_choice']}"
            print(
                f"{recipe}: kept {result['kept']} ({source}); untuned run: {result['untuned']}; "
                f"{result['kept_ms']:.2f} ms against {result['simulator_ms']:.2f} ms, ratio {result['ratio']:.3f} "
                f"(rounds {', '.join(f'{r:.3f}' for r in result['ratios'])}), noise {result['noise']:.3f}, "
                f"{'within' if result['ratio'] <= 1 + result['noise'] else 'OVER'} 1 + noise",
                flush=True,
            )
            for row in result["trials"]:
                print(f"    trial {row['label']}: simulated {row['simulated_ms']:.2f} ms, measured {row['measured_ms']:.2f} ms", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
