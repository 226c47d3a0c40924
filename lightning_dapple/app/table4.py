"""Plans of the full-size recipes beside DAPPLE's Table 4 (planning results on 16 V100s).

    python -m lightning_dapple.app.table4               # published V100 profiles (shared/)
    python -m lightning_dapple.app.table4 --estimate    # FLOP/byte estimates of our models
    python -m lightning_dapple.app.table4 --all         # all six models, ours vs the paper per cell
    python -m lightning_dapple.app.table4 --zero        # all six models planned without and with zero="auto"

For each recipe (VGG-19 GBS 2048, GNMT-16 GBS 1024, BERT-48 GBS 64) and cluster
(paper-a: 2x8 NVLink + 25 Gbit/s; paper-b: 16x1, 25 Gbit/s; paper-c: 16x1, 10 Gbit/s)
it runs the planner on the recipe's profile (``recipe_profile``) and prints a Markdown
table: the paper's plan and split, ours, M and the predicted step time. "Split" counts the
model's weight layers per stage as the paper does (VGG-19: 16 conv + 3 FC; GNMT-16: LSTM
layers; BERT-48: encoder layers), whatever else the profile's graph nodes hold.

``--zero`` plans every cell of Table 4 twice, as the paper's memory model does (every
replica keeps the whole optimizer state) and with ``zero="auto"`` (replicated stages may
shard it, ``plan/zero_choice.py``), and lists the cells whose plan or simulated step changes.
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Any

from lightning_dapple.app.recipe_profile import (
    recipe_global_batch,
    recipe_profile,
    shared_profiles_dir,
)
from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import require
from lightning_dapple.plan.dapple_planner import (
    data_parallel_candidates,
    straight_candidates,
)
from lightning_dapple.plan.evaluate import score_stages
from lightning_dapple.plan.plan import StagePlan
from lightning_dapple.plan.policy_choice import simulate_policies
from lightning_dapple.plan.request import PlanRequest
from lightning_dapple.plan.shape_bound import shape_lower_bound
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate.plan_and_schedule import make_plan, simulate_plan

__all__ = [
    "PAPER_TABLE4", "SIMULATED_PER_SHAPE", "TABLE4_MODELS", "category", "fastest_of_shape", "full_table_markdown", "main", "plan_recipe",
    "published_match", "published_shapes", "published_shapes_choice", "ruled_out", "shape_candidates",
    "table4_markdown", "table4_row", "table4_rows", "weight_layer_split", "zero_changed", "zero_markdown", "zero_row", "zero_rows",
]

# DAPPLE Table 4 (plan, split position) for the three recipes.
PAPER_TABLE4: dict[tuple[str, str], tuple[str, str]] = {
    ("vgg", "paper-a"): ("DP", "-"),
    ("vgg", "paper-b"): ("DP", "-"),
    ("vgg", "paper-c"): ("15:1", "13:6"),
    ("gnmt", "paper-a"): ("8:8", "9:7"),
    ("gnmt", "paper-b"): ("8:8", "9:7"),
    ("gnmt", "paper-c"): ("Straight", "-"),
    ("bert", "paper-a"): ("8:8", "23:25"),
    ("bert", "paper-b"): ("Straight", "-"),
    ("bert", "paper-c"): ("Straight", "-"),
}
TITLES = {"vgg": "VGG-19 (2048)", "gnmt": "GNMT-16 (1024)", "bert": "BERT-48 (64)"}

# Which profile layers are the paper's "layers" (graph-text node names, or our layer classes).
_WEIGHT_LAYER = {
    "vgg": re.compile(r"^(Conv2d|FC|Prediction)|\((ConvLayer|FCLayer|Linear)\)"),
    "gnmt": re.compile(r"LSTM\(|RecurrentAttention|\((EncoderLayer|AttentionDecoderLayer|DecoderLayer)\)"),
    "bert": re.compile(r"^layer_\d+|\(BertBlock\)"),
}


def weight_layer_split(recipe: str, profile: Any, plan: Any) -> str:
    """'a:b:...' = the paper's layers per stage ('-' for a single stage)."""
    if plan.num_stages == 1:
        return "-"
    pattern = _WEIGHT_LAYER[recipe]
    counts = [sum(1 for layer in profile.layers[s.start : s.end] if pattern.search(layer.name)) for s in plan.stages]
    return ":".join(str(c) for c in counts)


def _kind(plan: Any) -> str:
    kind = plan.kind()
    return {"straight": "Straight"}.get(kind, kind)


def plan_recipe(recipe: str, cluster: str, estimate: bool = False, device: str = "V100") -> dict[str, Any]:

    profile = recipe_profile(recipe, device=device, prefer_shared=not estimate)
    started = time.perf_counter()
    plan = make_plan(profile, load_cluster(cluster), recipe_global_batch(recipe))
    return {
        "recipe": recipe,
        "cluster": cluster,
        "profile": profile.name + (" [estimate]" if profile.estimated else ""),
        "plan": _kind(plan),
        "split": weight_layer_split(recipe, profile, plan),
        "micro_batches": plan.micro_batches,
        "latency_ms": plan.predicted.latency_ms if plan.predicted is not None else None,
        "planning_s": time.perf_counter() - started,
    }


def table4_markdown(rows: list[dict[str, Any]], source: str) -> str:
    planner = f"{make_plan.__module__}.{make_plan.__name__}"
    lines = [
        f"Plans on 16 V100 ({source}; planner {planner}) beside DAPPLE Table 4:",
        "",
        "| Model (GBS) | Config | Paper plan | Paper split | Our plan | Our split | M | Predicted step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"paper-a": "2x8 (A)", "paper-b": "16x1 (B)", "paper-c": "16x1 (C)"}
    for row in rows:
        paper_plan, paper_split = PAPER_TABLE4[(row["recipe"], row["cluster"])]
        latency = "-" if row["latency_ms"] is None else f"{row['latency_ms']:.0f} ms"
        lines.append(
            f"| {TITLES[row['recipe']]} | {names[row['cluster']]} | {paper_plan} | {paper_split} | "
            f"{row['plan']} | {row['split']} | {row['micro_batches']} | {latency} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- all six models

# DAPPLE Table 4, all six models on the published profiles: (label, profile under
# shared/profiles, profile batch size if not in the name, global batch, paper's plan per config)
TABLE4_MODELS: tuple[tuple[str, str, int | None, int, tuple[str, str, str]], ...] = (
    ("ResNet-50", "pipedream/resnet50.graph.txt", 64, 2048, ("DP", "DP", "DP")),
    ("VGG-19", "dapple/vgg-19-pbs-32.txt", None, 2048, ("DP", "DP", "15:1")),
    ("GNMT-16", "dapple/gnmt-16-pbs-64.txt", None, 1024, ("8:8", "8:8", "straight")),
    ("BERT-48", "dapple/bert-48-pbs-2.txt", None, 64, ("8:8", "straight", "straight")),
    ("XLNet-36", "dapple/xlnet-36-pbs-1.txt", None, 128, ("8:8", "8:8", "straight")),
    ("AmoebaNet-36", "dapple/amoeba-36-pbs-1.txt", None, 128, ("8:8", "11:5", "11:5")),
)
CONFIGS = ("paper-a", "paper-b", "paper-c")


def category(kind: str) -> str:
    """Table 4's categories: 'DP', 'straight', 'P:Q' (two stages); anything else 'other'."""
    if kind in ("DP", "straight", "single"):
        return kind
    return "P:Q" if kind.count(":") == 1 else "other"


# Plans of one shape simulated per shape: the best ones by formula 2, which can misrank
# plans within a shape (it ignores the bubbles inside the pivot stage, 4.1).
SIMULATED_PER_SHAPE = 8


def shape_candidates(request: PlanRequest, shape: str) -> list[Any]:
    """The plans of ``shape`` ('DP', 'straight' or 'P:Q') that fit, best formula latency
    first (``Scored``). DP and straight are the planner's own DP and straight candidates
    (every M); P:Q puts the first stage on ranks 0..P-1 and the second on the next Q, over
    every cut and every M."""
    profile, cluster, global_batch = request.profile, request.cluster, request.global_batch_size
    if shape == "DP":
        found = data_parallel_candidates(request)
    elif shape == "straight":
        found = straight_candidates(request, keep=SIMULATED_PER_SHAPE)
    else:
        p, q = (int(v) for v in shape.split(":"))
        found = []
        for m in request.micro_batches:
            if max(p, q) > (global_batch // m) // request.floor:
                continue
            for cut in range(1, profile.num_layers):
                stages = (StagePlan((0, cut), tuple(range(p))), StagePlan((cut, profile.num_layers), tuple(range(p, p + q))))
                found.append(score_stages(profile, cluster, stages, global_batch, m))
    return sorted((item for item in found if item.fits(cluster)), key=lambda item: item.latency_ms)


def fastest_of_shape(request: PlanRequest, shape: str) -> tuple[Any, float] | None:
    """(plan, simulated ms) of the fastest of the ``SIMULATED_PER_SHAPE`` best plans of
    ``shape``, each simulated as the planner prices its own plans (the faster K_i policy
    that fits); None when no plan of the shape is valid and fits."""
    best: tuple[Any, float] | None = None
    for item in shape_candidates(request, shape)[:SIMULATED_PER_SHAPE]:
        latency = simulate_policies(request, item).simulation.latency_ms
        if best is None or latency < best[1]:
            best = (item, latency)
    return best


def published_shapes(num_devices: int) -> list[str]:
    """The plan shapes the DAPPLE authors' published planner (HPGO, ``orchestrate.rs``) can
    return on ``num_devices`` devices: DP (its replicated DP search only ever keeps the
    one-stage plan), straight, and two stages P:Q over every cut (``compute_bipartition``)."""
    return ["DP", "straight"] + [f"{p}:{num_devices - p}" for p in range(1, num_devices)]


def _described(found: tuple[Any, float] | None) -> dict[str, Any] | None:
    if found is None:
        return None
    item, latency = found
    return {"ms": latency, "kind": item.kind(), "split": ":".join(str(s.end - s.start) for s in item.stages), "micro_batches": item.micro_batches}


def published_shapes_choice(request: PlanRequest) -> tuple[dict[str, Any] | None, dict[str, tuple[Any, float] | None]]:
    """What our cost model picks when the search is limited to the shapes the paper's
    planner could output: the fastest simulated of ``fastest_of_shape`` over
    ``published_shapes`` (kind, split, M, simulated ms; None when none is valid), and
    ``fastest_of_shape`` of every one of those shapes."""
    by_shape = {shape: fastest_of_shape(request, shape) for shape in published_shapes(request.cluster.num_devices)}
    valid = [pair for pair in by_shape.values() if pair is not None]
    return (_described(min(valid, key=lambda pair: pair[1])) if valid else None), by_shape


def table4_row(label: str, path: str, pbs: int | None, global_batch: int, config: str, paper_plan: str) -> dict[str, Any]:
    """Our plan for one cell of Table 4, the choice among the paper's planner's shapes and,
    where our category differs, the fastest plan of the paper's shape and how fast any plan
    of that shape could be."""

    root = shared_profiles_dir()
    require_profiles(root, path)
    profile = load_profile(root / path, profile_batch_size=pbs)
    cluster = load_cluster(config)
    started = time.perf_counter()
    plan = make_plan(profile, cluster, global_batch)
    row: dict[str, Any] = {
        "model": label, "config": config, "paper": paper_plan, "ours": plan.kind(),
        "split": ":".join(str(s.end - s.start) for s in plan.stages), "micro_batches": plan.micro_batches,
        "ours_ms": plan.predicted.simulated_latency_ms or plan.predicted.latency_ms, "planning_s": time.perf_counter() - started,
    }
    row["match"] = category(plan.kind()) == category(paper_plan)
    request = PlanRequest.build(profile, cluster, global_batch, policy="auto", simulate=simulate_plan)
    row["published"], by_shape = published_shapes_choice(request)
    if not row["match"]:
        # the paper's plans are all of those shapes; another shape is searched on its own
        other = _described(by_shape[paper_plan] if paper_plan in by_shape else fastest_of_shape(request, paper_plan))
        if other is not None:
            row["paper_ms"], row["paper_split"] = other["ms"], other["split"]
        bound = shape_lower_bound(request, paper_plan)
        if bound is not None:
            row["paper_bound_ms"] = bound[0]
    return row


def ruled_out(row: dict[str, Any]) -> bool:
    """Whether no plan of the paper's shape can step as fast as ours under the cost model
    (``shape_lower_bound`` above our simulated step): then no search or re-ranking of the
    model could choose the paper's plan."""
    return not row["match"] and row.get("paper_bound_ms", 0.0) > row["ours_ms"]


def require_profiles(root: Any, path: str) -> None:

    require(root is not None and (root / path).is_file(), "shared profiles", f"{path} is not found",
            "set $DAPPLE_SHARED_PROFILES to the folder holding dapple/ and pipedream/")


def table4_rows() -> list[dict[str, Any]]:
    """All 18 cells of Table 4 (six models x configs A, B, C)."""
    return [
        table4_row(label, path, pbs, gbs, config, paper[index])
        for label, path, pbs, gbs, paper in TABLE4_MODELS
        for index, config in enumerate(CONFIGS)
    ]


def full_table_markdown(rows: list[dict[str, Any]]) -> str:
    """Ours vs the paper per cell; where the category differs, the simulated step time of
    the fastest plan of the paper's shape beside ours and the lower bound on any plan of it
    (``shape_lower_bound``); and in every row the plan our model picks among the shapes the
    paper's planner can output (``published_shapes``)."""
    lines = [
        "| Model (GBS) | Config | Paper | Ours (layers per stage, M) | Same category | Ours, simulated | Paper's shape, simulated | "
        "Paper's shape, lower bound | Best of DP / straight / P:Q |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    gbs = {label: g for label, _, _, g, _ in TABLE4_MODELS}
    for row in rows:
        paper_ms = row.get("paper_ms")
        theirs = "-" if row["match"] else ("none valid" if paper_ms is None else f"{paper_ms:.0f} ms ({row['paper_split']})")
        lines.append(
            f"| {row['model']} ({gbs[row['model']]}) | {row['config']} | {row['paper']} | {row['ours']} ({row['split']}, M={row['micro_batches']}) | "
            f"{'yes' if row['match'] else 'no'} | {row['ours_ms']:.0f} ms | {theirs} | {_bound_cell(row)} | {_published_cell(row)} |"
        )
    lines.append("")
    lines.append(f"{sum(row['match'] for row in rows)} of {len(rows)} cells in the paper's category.")
    lines.append(
        f"{sum(published_match(row) for row in rows)} of {len(rows)} when our model chooses among the shapes the paper's "
        "planner can output (DP, straight, two stages)."
    )
    differing = sum(not row["match"] for row in rows)
    lines.append(
        f"In {sum(ruled_out(row) for row in rows)} of the {differing} differing cells no plan of the paper's shape (any cut, "
        "any M, any K_i, DAPPLE's or GPipe's schedule) can step as fast as ours under the cost model."
    )
    return "\n".join(lines)


def _bound_cell(row: dict[str, Any]) -> str:
    if row["match"] or "paper_bound_ms" not in row:
        return "-"
    return f">= {row['paper_bound_ms']:.0f} ms" + (" (ruled out)" if ruled_out(row) else "")


def published_match(row: dict[str, Any]) -> bool:
    """Whether the choice limited to ``published_shapes`` lands in the paper's category."""
    found = row.get("published")
    return found is not None and category(found["kind"]) == category(row["paper"])


def _published_cell(row: dict[str, Any]) -> str:
    found = row.get("published")
    if found is None:
        return "none valid"
    return f"{found['kind']} ({found['split']}, M={found['micro_batches']}) {found['ms']:.0f} ms"


# --------------------------------------------------------------------------- with ZeRO

#: a simulated step that moves by less than this fraction is the same step
SAME_STEP = 1e-6


def _planned(plan: Any) -> dict[str, Any]:
    return {
        "kind": plan.kind(), "split": ":".join(str(s.end - s.start) for s in plan.stages), "micro_batches": plan.micro_batches,
        "zero": [s.zero for s in plan.stages], "ms": plan.predicted.simulated_latency_ms or plan.predicted.latency_ms,
    }


def zero_row(label: str, path: str, pbs: int | None, global_batch: int, config: str) -> dict[str, Any]:
    """One cell of Table 4 planned without ZeRO (the paper's memory model) and with
    ``zero="auto"``, each with its planning time."""
    root = shared_profiles_dir()
    require_profiles(root, path)
    profile = load_profile(root / path, profile_batch_size=pbs)
    cluster = load_cluster(config)
    row: dict[str, Any] = {"model": label, "config": config}
    for key, zero in (("whole", 0), ("zero", "auto")):
        started = time.perf_counter()
        plan = make_plan(profile, cluster, global_batch, zero=zero)
        row[key] = _planned(plan) | {"planning_s": time.perf_counter() - started}
    return row


def zero_rows() -> list[dict[str, Any]]:
    """``zero_row`` for all 18 cells of Table 4."""
    return [zero_row(label, path, pbs, gbs, config) for label, path, pbs, gbs, _ in TABLE4_MODELS for config in CONFIGS]


def zero_changed(row: dict[str, Any]) -> bool:
    """Whether allowing ZeRO changes the cell's plan (shape, cut, M or a stage's level) or its simulated step."""
    whole, zero = row["whole"], row["zero"]
    same_plan = all(whole[key] == zero[key] for key in ("kind", "split", "micro_batches", "zero"))
    return not same_plan or abs(zero["ms"] - whole["ms"]) > SAME_STEP * whole["ms"]


def _zero_cell(planned: dict[str, Any]) -> str:
    sharded = [str(index) for index, level in enumerate(planned["zero"]) if level]
    levels = f", ZeRO-{max(planned['zero'])} on {','.join(sharded)}" if sharded else ""
    return f"{planned['kind']} ({planned['split']}, M={planned['micro_batches']}{levels})"


def zero_markdown(rows: list[dict[str, Any]]) -> str:
    """Each cell's plan and simulated step without and with ZeRO, and how many change."""
    lines = [
        "| Model | Config | Without ZeRO (layers per stage, M) | Simulated | With zero=\"auto\" | Simulated | Change |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        whole, zero = row["whole"], row["zero"]
        change = f"{100.0 * (zero['ms'] / whole['ms'] - 1.0):+.1f}%" if zero_changed(row) else "-"
        lines.append(
            f"| {row['model']} | {row['config']} | {_zero_cell(whole)} | {whole['ms']:.0f} ms | {_zero_cell(zero)} | {zero['ms']:.0f} ms | {change} |"
        )
    changed = [row for row in rows if zero_changed(row)]
    sharding = [row for row in changed if any(row["zero"]["zero"])]
    lines.append("")
    lines.append(
        f"{len(changed)} of {len(rows)} cells change (plan or simulated step); in {len(sharding)} of them the new plan shards "
        "a stage's optimizer state."
    )
    seconds = [(row["whole"]["planning_s"], row["zero"]["planning_s"]) for row in rows]
    lines.append(f"Planning took {sum(a for a, _ in seconds):.1f} s without ZeRO and {sum(b for _, b in seconds):.1f} s with zero=\"auto\" in all.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimate", action="store_true", help="plan from FLOP/byte estimates of our models instead of the published profiles")
    parser.add_argument("--recipes", nargs="+", default=["vgg", "gnmt", "bert"])
    parser.add_argument("--clusters", nargs="+", default=["paper-a", "paper-b", "paper-c"])
    parser.add_argument("--all", action="store_true", help="all six models of Table 4 on the published profiles, with the paper's choice where ours differs")
    parser.add_argument("--zero", action="store_true", help="all six models planned without ZeRO and with zero='auto', and the cells that change")
    args = parser.parse_args(argv)
    if args.zero:
        print(zero_markdown(zero_rows()))
        return
    if args.all:
        print(full_table_markdown(table4_rows()))
        return
    rows = [plan_recipe(recipe, cluster, estimate=args.estimate) for recipe in args.recipes for cluster in args.clusters]
    source = "FLOP/byte estimates of lightning_dapple.models, V100 peak rates" if args.estimate else "published V100 profiles, shared/profiles/dapple"
    print(table4_markdown(rows, source))


if __name__ == "__main__":
    main()
