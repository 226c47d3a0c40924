"""Plans of the full-size recipes beside DAPPLE's Table 4 (planning results on 16 V100s).

    python -m lightning_dapple.app.table4               # published V100 profiles (shared/)
    python -m lightning_dapple.app.table4 --estimate    # FLOP/byte estimates of our models

For each recipe (VGG-19 GBS 2048, GNMT-16 GBS 1024, BERT-48 GBS 64) and cluster
(paper-a: 2x8 NVLink + 25 Gbit/s; paper-b: 16x1, 25 Gbit/s; paper-c: 16x1, 10 Gbit/s)
it runs the planner on the recipe's profile (``recipe_profile``) and prints a Markdown
table: the paper's plan and split, ours, M and the predicted step time. "Split" counts the
model's weight layers per stage as the paper does (VGG-19: 16 conv + 3 FC; GNMT-16: LSTM
layers; BERT-48: encoder layers), whatever else the profile's graph nodes hold.
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Any, Callable

__all__ = ["PAPER_TABLE4", "main", "plan_recipe", "table4_markdown", "weight_layer_split"]

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


def _planner() -> tuple[Callable[..., Any], str]:
    try:
        from lightning_dapple.plan.api import make_plan

        return make_plan, "lightning_dapple.plan.api.make_plan"
    except ImportError:
        from lightning_dapple.plan.dapple_planner import plan_dapple

        return plan_dapple, "lightning_dapple.plan.dapple_planner.plan_dapple"


def _kind(plan: Any) -> str:
    kind = plan.kind()
    return {"straight": "Straight"}.get(kind, kind)


def plan_recipe(recipe: str, cluster: str, estimate: bool = False, device: str = "V100") -> dict[str, Any]:
    from lightning_dapple.app.recipe_profile import recipe_global_batch, recipe_profile
    from lightning_dapple.cluster import load_cluster

    planner, _ = _planner()
    profile = recipe_profile(recipe, device=device, prefer_shared=not estimate)
    started = time.perf_counter()
    plan = planner(profile, load_cluster(cluster), recipe_global_batch(recipe))
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
    _, planner = _planner()
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimate", action="store_true", help="plan from FLOP/byte estimates of our models instead of the published profiles")
    parser.add_argument("--recipes", nargs="+", default=["vgg", "gnmt", "bert"])
    parser.add_argument("--clusters", nargs="+", default=["paper-a", "paper-b", "paper-c"])
    args = parser.parse_args(argv)
    rows = [plan_recipe(recipe, cluster, estimate=args.estimate) for recipe in args.recipes for cluster in args.clusters]
    source = "FLOP/byte estimates of lightning_dapple.models, V100 peak rates" if args.estimate else "published V100 profiles, shared/profiles/dapple"
    print(table4_markdown(rows, source))


if __name__ == "__main__":
    main()
