"""Is the plan ``tune_steps`` keeps ever slower than the simulator's? Each tiny recipe, tuned.

For each recipe (default: the 4 tiny recipes, the quick start's ``bert_pipeline_tiny`` among
them) on 4 CPU processes (``_measured_steps.train``):

1. ``dapple-train recipe=NAME strategy.tune_steps=N`` with a fresh tuning cache: the plans
   measured, each one's simulated and measured trial step, the plan kept, and the
   simulator's choice on the same planning inputs (the plan an untuned run with this
   profile, these links and this optimizer probe executes: ``extra.tuning.simulator_plan``
   where the two differ);
2. ``--rounds`` pairs: the kept plan and the simulator's choice, each from its plan file, one
   right after the other (the order alternates between rounds), ``--steps`` steps each.

The verdict per recipe is kept / simulator's, the median over rounds of each round's
ratio of median steps. The target is that it never exceeds 1 + the round-to-round noise,
taken as the larger relative spread (max - min over median) of either plan's steps over
the rounds. Where tuning kept the simulator's choice the two files hold the same plan, and
the pairs measure only the noise.

Beside the times, each rank's peak memory (``result.json``'s ``peak_memory_bytes_per_rank``)
of the tuned run against the most any round's untuned run of the kept plan reached: what
the trials add to a rank's peak.

A fresh untuned run plans on its own measurements (a new profile, new link and optimizer
probes), and on these tiny recipes that alone moves its plan between near-equal cuts and
shapes; the pairs therefore compare plans made from one planning run.

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



def spread(values: list[float]) -> float:
    """(max - min) / median: how far apart one plan's rounds land."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def recipe_tuning(recipe: str, work: Path, steps: int, rounds: int, tune_steps: int) -> dict[str, Any]:
    """Runs 1-2 of the module docstring for one recipe."""
    cache = f"strategy.profile_cache={work / f'{recipe}-cache'}"
    tuned = _measured_steps.train(recipe, work / f"{recipe}-tuned", steps, (f"strategy.tune_steps={tune_steps}", cache))
    kept_file = Path(tuned["run_dir"]) / "dapple_plan.json"
    record = json.loads(kept_file.read_text())["extra"]["tuning"]
    simulator_file = kept_file
    if "simulator_plan" in record:
        simulator_file = work / f"{recipe}-simulator-plan.json"
        simulator_file.write_text(json.dumps(record["simulator_plan"]))
    runs: dict[str, list[float]] = {"kept": [], "simulator": []}
    kept_memory: list[list[int]] = []  # per round, each rank's peak memory running the kept plan untuned
    for index in range(rounds):
        order = [("kept", kept_file), ("simulator", simulator_file)]
        for label, plan_file in order if index % 2 == 0 else order[::-1]:
            run = _measured_steps.train(recipe, work / f"{recipe}-{label}-{index}", steps, (f"strategy.plan={plan_file}",))
            runs[label].append(run["measured_ms"])
            if label == "kept":
                kept_memory.append(run["peak_memory_bytes_per_rank"])
    ratios = [kept / simulator for kept, simulator in zip(runs["kept"], runs["simulator"])]
    return {
        "recipe": recipe,
        "kept": record["chosen"],
        "simulator_choice": record["simulator_choice"],
        "margin": record.get("margin"),
        "trials": record["candidates"],
        "kept_ms": statistics.median(runs["kept"]),
        "simulator_ms": statistics.median(runs["simulator"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "noise": max(spread(runs["kept"]), spread(runs["simulator"])),
        "memory_kind": tuned["peak_memory_kind"],
        "tuned_peak_memory_bytes_per_rank": tuned["peak_memory_bytes_per_rank"],
        "kept_peak_memory_bytes_per_rank": [max(each) for each in zip(*kept_memory)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(_measured_steps.TINY_RECIPES))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune-steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for recipe in args.recipes:
            result = recipe_tuning(recipe, Path(scratch), args.steps, args.rounds, args.tune_steps)
            results.append(result)
            source = "the simulator's choice" if result["kept"] == result["simulator_choice"] else f"simulator: {result['simulator_choice']}"
            print(
                f"{recipe}: kept {result['kept']} ({source}); "
                f"{result['kept_ms']:.2f} ms against {result['simulator_ms']:.2f} ms, ratio {result['ratio']:.3f} "
                f"(rounds {', '.join(f'{r:.3f}' for r in result['ratios'])}), noise {result['noise']:.3f}, "
                f"{'within' if result['ratio'] <= 1 + result['noise'] else 'OVER'} 1 + noise",
                flush=True,
            )
            mib = 1 / 2**20
            print(
                f"    peak memory per rank ({result['memory_kind']}): tuned run "
                f"{' / '.join(f'{b * mib:.0f}' for b in result['tuned_peak_memory_bytes_per_rank'])} MiB, the kept plan untuned "
                f"{' / '.join(f'{b * mib:.0f}' for b in result['kept_peak_memory_bytes_per_rank'])} MiB (most over the rounds)",
                flush=True,
            )
            for row in result["trials"]:
                print(f"    trial {row['label']}: simulated {row['simulated_ms']:.2f} ms, measured {row['measured_ms']:.2f} ms", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
