"""Fidelity: the planner's formula (DAPPLE 4.1, formulas 1-2) against the discrete-event simulator.

    python benchmarks/bench_fidelity.py                      # 240 random instances + every profile x paper-a/b/c
    python benchmarks/bench_fidelity.py --budget-s 120 --clusters paper-a
    python benchmarks/bench_fidelity.py --out benchmarks/results/fidelity.json --md benchmarks/results/fidelity.md
    python benchmarks/bench_fidelity.py --measured           # simulated vs measured on 4 CPU processes (~3 min)

The planner ranks plans by DAPPLE's closed formula L = T_w + T_s + T_e (sec. 4.1, formulas
1-2, pivot Q from Algorithm 1 of sec. 4.3); the simulator (``lightning_dapple.simulate``)
*runs* the same schedule on the same per-stage costs. Both sides use ``plan.costs.stage_costs``,
so any difference is the formula's own simplification, never a different cost model.

Rows come from (1) the random instances the planner's optimality test also uses
(``simulate.fidelity.random_instance``, seed 20240601, default 240 instances: up to 8 layers, up to 2 machines x 4
devices or 8 flat devices), each planned by ``make_plan(..., min_slice=1)`` as the optimality
test plans them, and (2) every profile in shared/profiles/ (dapple/ and pipedream/) on the
paper's clusters, planned by ``make_plan`` with the Table-4 global batch of the model family.
Plans are made with policy P_A, the K_i the search sizes memory with, so that every row
prices one schedule; ``policy="auto"`` (the planner's default) runs a plan with P_B where that
simulates faster, which the P_B column below shows per cause.

The analysis itself -- the formula at a forced pivot, the exact decomposition, the pacing
bounds, one row per plan -- is ``lightning_dapple.simulate.fidelity``; this script runs it over
the instances and profiles and writes the tables. Each row is decomposed exactly
(``decompose``): with Q the pivot phase (a computation stage,
or a communication stage, which 4.1 counts as a stage of its own),

    simulated - formula = start delay + idle inside Q - act/grad overlap on Q + tail excess

where "idle inside Q" is the pivot bubble the paper says formula 1-2 ignores, split by what Q
waits for; "overlap" is the time a communication pivot moves an activation and a gradient at
once (the simulator has one link per direction, the formula runs a communication stage's F
and B back to back); "tail excess" is how much the simulated ending phase outlasts T_e - B_Q.
A row whose formula is off by more than 10% gets the dominant term as its cause and, for the
bubbles, the steady-period bound that paces the pipeline instead of Q (``Pacing``: a heavier
stage Algorithm 1 left unpicked, or an "in-flight loop" -- a cycle of the early-backward
schedule through stages u..w and their links that advances only K_u - K_w + 1 micro-batches,
DAPPLE 5.3). Two checks back the explanation with the simulator itself: the pivot's measured
steady period against that bound (M >= 16), and each > 10% row re-simulated with policy P_B's
deeper warm-up (5.3), which the paper introduces to overlap communication.

Profiles are planned under a wall-clock budget (``--budget-s``); what does not fit is listed
as skipped in the table, the JSON and the markdown, never dropped.

``--measured`` sets the simulator against the executor instead (``_measured_steps``): each
tiny recipe trained by ``dapple-train`` for ``--steps`` steps on 4 CPU processes (its plan
simulated on the profile and the cluster that run measured at set-up: the layers, the
executor's overhead per action, the optimizer step per layer, and the processes' AllReduce
and transfer costs, the user's step around the layers; also without the executor's
overhead, and without the step's glue), and the benchmark MLP as 4
single-rank stages at M = 8; measured step = median over the steps after warm-up of the
slowest rank. Target: measured within 15 % of simulated.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table

from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.plan import Plan
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.profile.model_profile import ModelProfile
from lightning_dapple.simulate.fidelity import CAUSES, SEED, THRESHOLD, Row, fidelity_row, random_rows
from lightning_dapple.simulate.plan_and_schedule import make_plan

REPO = Path(__file__).resolve().parents[1]
CLUSTERS = ("paper-a", "paper-b", "paper-c")

# Global batch per model family: DAPPLE Table 4 where the paper plans the model (VGG-19 2048,
# GNMT-16 1024, BERT-48 64, XLNet-36 128, AmoebaNet-36 128); siblings take their family's
# batch, and every image model takes VGG-19's.
FAMILY_BATCH = (("gnmt", 1024), ("bert", 64), ("xlnet", 128), ("amoeba", 128))
IMAGE_BATCH = 2048
GRAPH_PBS = 64  # PipeDream's graph files without pbs-N in the name are batch 64 (profiles README)


# --------------------------------------------------------------------------- inputs


def shared_profiles() -> Path:
    """shared/profiles beside the checkout (as CI clones it), else the workplace copy."""
    beside = REPO.parent / "shared" / "profiles"
    return beside if beside.is_dir() else Path("/work/shared/profiles")


def profile_files() -> list[Path]:
    root = shared_profiles()
    return sorted(root.glob("dapple/*.txt")) + sorted(root.glob("pipedream/*.txt"))


def batch_for(path: Path) -> int:
    """The global batch a profile is planned with (Table 4 conventions, see FAMILY_BATCH)."""
    name = path.name.lower()
    for family, batch in FAMILY_BATCH:
        if family in name:
            return batch
    return IMAGE_BATCH


def read_profile(path: Path) -> ModelProfile:
    """Graph files without ``pbs-N`` in the name are batch 64 (shared/profiles/README.md)."""
    return load_profile(path, None if re.search(r"pbs-\d+", path.name) else GRAPH_PBS)


class OutOfTime(Exception):
    pass


def with_deadline(seconds: float, work: Callable[[], Plan]) -> Plan:
    """Run ``work`` and raise ``OutOfTime`` if it is still running after ``seconds``.

    The planner is pure Python/NumPy, so a SIGALRM handler can interrupt it; the remaining
    budget thus bounds even a single profile that would not fit.
    """

    def expire(signum: int, frame: Any) -> None:
        raise OutOfTime()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        return work()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def profile_rows(clusters: Sequence[str], budget_s: float, console: Console | None = None) -> tuple[list[Row], list[dict[str, Any]]]:
    """Every profile on every cluster, cluster by cluster (all of paper-a first), within budget."""
    rows: list[Row] = []
    skipped: list[dict[str, Any]] = []
    deadline = time.perf_counter() + budget_s
    root = shared_profiles()
    for cluster_name in clusters:
        cluster = load_cluster(cluster_name)
        for path in profile_files():
            name = str(path.relative_to(root))
            gbs = batch_for(path)
            left = deadline - time.perf_counter()
            base = {"source": "profile", "name": name, "cluster": cluster_name, "global_batch_size": gbs}
            if left <= 0:
                skipped.append({**base, "reason": f"budget of {budget_s:g} s spent before it started"})
                continue
            profile = read_profile(path)
            start = time.perf_counter()
            try:
                plan = with_deadline(left, lambda: make_plan(profile, cluster, gbs, policy="PA"))
            except OutOfTime:
                skipped.append({**base, "reason": f"planning did not finish in the {left:.0f} s of budget left"})
                continue
            except DappleConfigError as exc:
                skipped.append({**base, "reason": f"no valid plan: {str(exc)[:160]}"})
                continue
            row = fidelity_row(plan, profile, cluster, "profile", name, time.perf_counter() - start)
            rows.append(row)
            if console is not None:
                console.print(f"  {name} on {cluster_name}: {row.plan}, M={row.micro_batches}, {100 * row.rel:+.1f}% ({row.plan_s:.1f} s)")
    return rows, skipped


# --------------------------------------------------------------------------- summary


def summarise(rows: Sequence[Row]) -> dict[str, Any]:
    """Counts within 1/5/10% and above, by direction, and the causes of the > 10% gaps."""
    out: dict[str, Any] = {"rows": len(rows)}
    for limit in (0.01, 0.05, 0.10):
        out[f"within_{round(limit * 100)}pct"] = sum(1 for r in rows if abs(r.rel) <= limit)
    over = [r for r in rows if abs(r.rel) > THRESHOLD]
    out["over_10pct"] = len(over)
    out["over_10pct_formula_low"] = sum(1 for r in over if r.rel < 0)
    out["over_10pct_formula_high"] = sum(1 for r in over if r.rel > 0)
    causes: dict[str, int] = {}
    paced: dict[str, int] = {}
    for r in over:
        causes[r.cause or ""] = causes.get(r.cause or "", 0) + 1
        key = f"{r.cause} / paced by {r.paced_by}" if r.paced_by else str(r.cause)
        paced[key] = paced.get(key, 0) + 1
    out["causes"] = dict(sorted(causes.items(), key=lambda kv: -kv[1]))
    out["causes_with_pacing"] = dict(sorted(paced.items(), key=lambda kv: -kv[1]))
    out["max_abs_residual_ms"] = max((abs(r.decomposition.residual) for r in rows), default=0.0)
    out["best_pivot_within_10pct_of_over"] = sum(1 for r in over if abs(r.best_pivot_formula_ms / r.simulated_ms - 1) <= THRESHOLD)
    periods = [r.period_ms / r.pace.period_ms - 1 for r in rows if r.period_ms is not None and r.stages > 1]
    out["period_rows"] = len(periods)
    out["period_max_abs_dev"] = max((abs(p) for p in periods), default=0.0)
    return out


def worst(rows: Sequence[Row], count: int = 10) -> list[Row]:
    return sorted(rows, key=lambda r: -abs(r.rel))[:count]


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def _terms_text(row: Row) -> str:
    terms = {k: v for k, v in row.decomposition.terms().items() if abs(v) > 1e-6}
    return ", ".join(f"{k} {v:+.1f}" for k, v in sorted(terms.items(), key=lambda kv: -abs(kv[1])))


def print_tables(console: Console, random_: Sequence[Row], profiles: Sequence[Row], skipped: Sequence[dict[str, Any]]) -> None:
    """Rich tables: counts per set, worst random instances, every profile row."""
    counts = Table(title="Formula (DAPPLE 4.1) vs simulator: |formula/simulated - 1|")
    for header in ("set", "rows", "<= 1%", "<= 5%", "<= 10%", "> 10% (formula low / high)"):
        counts.add_column(header)
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        s = summarise(rows)
        counts.add_row(label, str(s["rows"]), str(s["within_1pct"]), str(s["within_5pct"]), str(s["within_10pct"]), f"{s['over_10pct']} ({s['over_10pct_formula_low']} / {s['over_10pct_formula_high']})")
    console.print(counts)
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        causes = summarise(rows)["causes_with_pacing"]
        if causes:
            console.print(f"causes of > 10% gaps, {label}: " + "; ".join(f"{k}: {v}" for k, v in causes.items()))
    table = Table(title="Worst random instances")
    for header in ("instance", "cluster", "plan", "M", "K", "formula", "simulated", "diff", "pivot", "cause", "paced by", "terms (ms)"):
        table.add_column(header)
    for r in worst(random_):
        table.add_row(r.name, r.cluster, r.plan, str(r.micro_batches), str(r.warmups), f"{r.formula_ms:.1f}", f"{r.simulated_ms:.1f}", _pct(r.rel), _pivot_text(r), r.cause or "", r.paced_by or "", _terms_text(r))
    console.print(table)
    table = Table(title="Profiles (shared/profiles)")
    for header in ("profile", "cluster", "GBS", "plan", "M", "formula", "simulated", "diff", "pivot", "cause", "paced by", "plan s"):
        table.add_column(header)
    for r in profiles:
        table.add_row(r.name, r.cluster, str(r.global_batch_size), r.plan, str(r.micro_batches), f"{r.formula_ms:.1f}", f"{r.simulated_ms:.1f}", _pct(r.rel), _pivot_text(r), r.cause or "", r.paced_by or "", f"{r.plan_s:.1f}")
    for item in skipped:
        table.add_row(item["name"], item["cluster"], str(item["global_batch_size"]), "[yellow]skipped[/yellow]", "", "", "", "", "", item["reason"], "", "")
    console.print(table)


def _pb_text(rows: Sequence[Row], against_formula: bool = False) -> str:
    """Median of the P_B simulation relative to the P_A simulation (or to the formula)."""
    changes = sorted(r.simulated_pb_ms / (r.formula_ms if against_formula else r.simulated_ms) - 1 for r in rows if r.simulated_pb_ms is not None)
    return _pct(changes[len(changes) // 2]) if changes else "-"


def _pivot_text(row: Row) -> str:
    d = row.decomposition
    return f"stage {d.pivot_index}" if d.pivot_kind == "stage" else f"link {d.pivot_index}->{d.pivot_index + 1}"


def markdown(random_: Sequence[Row], unplannable: Sequence[dict[str, Any]], profiles: Sequence[Row], skipped: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown summary written next to the JSON."""
    lines = [
        "# Fidelity: planner formula (DAPPLE 4.1, formulas 1-2) vs simulator",
        "",
        f"Generated by `{meta['command']}` in {meta['wall_s']:.0f} s (2-core CPU machine). "
        "diff = formula / simulated - 1 (negative: the formula under-estimates). "
        "Causes come from the exact decomposition simulated - formula = start delay + idle inside the pivot "
        "- act/grad overlap on a communication pivot + ending excess (max |residual| "
        f"{max(summarise([*random_, *profiles])['max_abs_residual_ms'], 0):.1e} ms); see the docstring of "
        "`benchmarks/bench_fidelity.py`.",
        "",
        "| set | rows | <= 1% | <= 5% | <= 10% | > 10% (formula low / high) |",
        "|---|---|---|---|---|---|",
    ]
    for label, rows in ((f"random instances (seed {meta['seed']}, {meta['instances']} drawn, {len(unplannable)} without a valid plan)", random_), ("profiles", profiles)):
        s = summarise(rows)
        lines.append(f"| {label} | {s['rows']} | {s['within_1pct']} | {s['within_5pct']} | {s['within_10pct']} | {s['over_10pct']} ({s['over_10pct_formula_low']} / {s['over_10pct_formula_high']}) |")
    lines += [
        "",
        "## Causes of the > 10% gaps",
        "",
        "cause = the decomposition term that carries the gap; paced by = the largest steady-period bound "
        "(`Pacing`); P_B = median change of the simulated step when the same plan runs with P_B's K_i "
        "(DAPPLE 5.3, memory not checked) instead of P_A's; P_B vs formula = median of that simulation / formula - 1.",
        "",
        "| cause | paced by | random | profiles | P_B | P_B vs formula |",
        "|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], list[list[Row]]] = {}
    for index, rows in enumerate((random_, profiles)):
        for r in rows:
            if r.cause is not None:
                groups.setdefault((r.cause, r.paced_by or "-"), [[], []])[index].append(r)
    for (cause, paced), (a, b) in sorted(groups.items(), key=lambda kv: -len(kv[1][0]) - len(kv[1][1])):
        lines.append(f"| {cause} | {paced} | {len(a)} | {len(b)} | {_pb_text([*a, *b])} | {_pb_text([*a, *b], against_formula=True)} |")
    keys = groups
    for label, rows in (("random instances", random_), ("profiles", profiles)):
        s = summarise(rows)
        if s["period_rows"]:
            lines.append(
                f"\n{label}: on the {s['period_rows']} pipelined rows with M >= 16 the pivot's measured steady period "
                f"(middle half of the micro-batches) is within {100 * s['period_max_abs_dev']:.1f}% of the largest bound of `Pacing`."
            )
        if s["over_10pct"]:
            lines.append(
                f"\n{label}: of the {s['over_10pct']} rows off by more than 10%, {s['best_pivot_within_10pct_of_over']} would be within "
                "10% had formulas 1-2 used the computation stage with the largest estimate as pivot instead of Algorithm 1's."
            )
    lines += ["", "Cause keys:", ""]
    lines += [f"- `{key}`: {text}" for key, text in CAUSES.items() if any(key == k[0] for k in keys)]
    lines += [
        "- paced by (steady-period bounds, ms per micro-batch; a cycle of the early-backward schedule from stage u "
        "to stage w and back holds F+B of every stage and link in between and advances K_u - K_w + 1 micro-batches): "
        "`heavier-stage`: one stage's F+B exceeds the pivot's (Algorithm 1 keeps a later, lighter pivot when M is small); "
        "`in-flight-loop`: a segment of stages with its links, (sum F+B) / (K_u - K_w + 1), exceeds every single stage "
        "(K_i counts computation stages, the round trip also crosses the links); `link`: one transfer per micro-batch "
        "on the slowest link; `pivot`: nothing exceeds F_Q+B_Q, the bubble is a one-off of the warm-up or ending.",
        "",
        "## Worst random instances",
        "",
        "| instance | cluster | plan | M | K | formula ms | simulated ms | diff | pivot | cause | paced by | terms (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in worst(random_):
        lines.append(f"| {r.name} | {r.cluster} | {r.plan} | {r.micro_batches} | {r.warmups} | {r.formula_ms:.1f} | {r.simulated_ms:.1f} | {_pct(r.rel)} | {_pivot_text(r)} | {r.cause or ''} | {r.paced_by or ''} | {_terms_text(r)} |")
    lines += [
        "",
        "## Profiles",
        "",
        "| profile | cluster | GBS | plan | M | formula ms | simulated ms | diff | pivot | cause | paced by | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in profiles:
        lines.append(f"| {r.name} | {r.cluster} | {r.global_batch_size} | {r.plan} | {r.micro_batches} | {r.formula_ms:.1f} | {r.simulated_ms:.1f} | {_pct(r.rel)} | {_pivot_text(r)} | {r.cause or ''} | {r.paced_by or ''} | {r.plan_s:.1f} |")
    for item in skipped:
        lines.append(f"| {item['name']} | {item['cluster']} | {item['global_batch_size']} | skipped | | | | | | {item['reason']} | | |")
    if unplannable:
        lines += ["", f"Random instances without a valid plan ({len(unplannable)}): " + ", ".join(item["name"].split()[-1] for item in unplannable) + "."]
    return "\n".join(lines) + "\n"


def _rounded(value: Any) -> Any:
    """Floats to 7 significant digits: the JSON stays readable and diffable."""
    if isinstance(value, float):
        return float(f"{value:.7g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(item) for item in value]
    return value


MLP = {"width": 512, "layers": 8, "batch": 256, "micro_batches": 8, "ooo": False, "warmup": 5}
#: what ``--measured`` runs: the tiny recipes and the benchmark MLP
MEASURED = ("bert_tiny", "gnmt_tiny", "vgg_tiny", "bert_pipeline_tiny", "mlp")


def measured_rows(steps: int, recipes: Sequence[str] = MEASURED, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Simulated against measured steps (module docstring, ``--measured``) of ``recipes``
    (tiny recipe names, "mlp" for the benchmark MLP); ``overrides`` go to every recipe run
    (e.g. ``trainer.devices=1``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _measured_steps

    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="fidelity_measured_") as tmp:
        for recipe in (name for name in recipes if name != "mlp"):
            rows.append(_measured_steps.train(recipe, Path(tmp) / recipe, steps, tuple(overrides)))
    if "mlp" in recipes:
        rows.append(_measured_steps.mlp({**MLP, "steps": steps}))
    print(
        "| model | plan | M | ooo | simulated ms | without overhead ms | without step glue ms | measured ms | measured / simulated | within 15 % "
        "| executor ms | executor / simulated less optimizer | compute, measured / simulated | optimizer ms, measured / simulated |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ratio = row["measured_ms"] / row["simulated_ms"]
        busy = f"{row['measured_busy_ms'] / row['simulated_busy_ms']:.2f}" if row.get("measured_busy_ms") and row.get("simulated_busy_ms") else "-"
        optimizer = f"{row['measured_optimizer_ms']:.1f} / {row['simulated_optimizer_ms']:.1f}" if row.get("measured_optimizer_ms") is not None else "-"
        executor = row.get("measured_executor_ms")
        # the executor's step ends before the optimizer step, which the simulated step holds
        pipeline_simulated = row["simulated_ms"] - row["simulated_optimizer_ms"]
        executor_text = f"{executor:.1f} | {executor / pipeline_simulated:.2f}" if executor else "- | -"
        print(
            f"| {row['recipe']} | {row['plan']} | {row['micro_batches']} | {'on' if row['ooo'] else 'off'} | {row['simulated_ms']:.1f} | "
            f"{row['simulated_no_overhead_ms']:.1f} | {row.get('simulated_no_glue_ms', row['simulated_ms']):.1f} | {row['measured_ms']:.1f} | {ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.15 else 'no'} | {executor_text} | {busy} | {optimizer} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measured", action="store_true", help="simulated vs measured steps of the tiny recipes and the MLP (4 CPU processes)")
    parser.add_argument("--steps", type=int, default=60, help="--measured: training steps per run")
    parser.add_argument("--recipes", nargs="+", default=list(MEASURED), help="--measured: tiny recipes to run, 'mlp' for the benchmark MLP")
    parser.add_argument("--overrides", nargs="*", default=[], help="--measured: Hydra overrides for every recipe run, e.g. trainer.devices=1")
    parser.add_argument("--instances", type=int, default=240, help="random instances drawn (the optimality test's 240)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget for planning the profiles")
    parser.add_argument("--clusters", nargs="+", default=list(CLUSTERS), help="cluster presets for the profiles")
    parser.add_argument("--out", default=None, help="write every row as JSON")
    parser.add_argument("--md", default=None, help="write the markdown summary")
    args = parser.parse_args(argv)
    if args.measured:
        rows = measured_rows(args.steps, args.recipes, args.overrides)
        if args.out:
            Path(args.out).write_text(json.dumps(_rounded(rows), indent=1) + "\n")
        return 0
    console = make_console()
    start = time.perf_counter()
    random_, unplannable = random_rows(args.instances, args.seed)
    console.print(f"{len(random_)} random instances planned and simulated ({len(unplannable)} without a valid plan) in {time.perf_counter() - start:.1f} s")
    profiles, skipped = profile_rows(args.clusters, args.budget_s, console)
    wall = time.perf_counter() - start
    print_tables(console, random_, profiles, skipped)
    command = "python benchmarks/bench_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": command.strip(), "seed": args.seed, "instances": args.instances, "budget_s": args.budget_s, "clusters": args.clusters, "wall_s": wall, "threshold": THRESHOLD}
    if args.out:
        data = {
            "meta": meta,
            "causes": CAUSES,
            "summary": {"random": summarise(random_), "profiles": summarise(profiles)},
            "random": [r.to_dict() for r in random_],
            "random_unplannable": unplannable,
            "profiles": [r.to_dict() for r in profiles],
            "profiles_skipped": skipped,
        }
        Path(args.out).write_text(json.dumps(_rounded(data), indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(random_, unplannable, profiles, skipped, meta))
    console.print(f"wall time {wall:.0f} s; {len(skipped)} profile row(s) skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
