"""Write tests/data/planner_before.json: the planners' plans on every shared profile.

    .venv/bin/python tests/data/make_planner_before.py [--out tests/data/planner_before.json]

Run it against the planner to be recorded (e.g. an older checkout on PYTHONPATH). A frozen record of what ``plan_dapple`` and ``plan_pipedream`` chose on every profile in
shared/profiles (dapple/ and pipedream/) for DAPPLE's three clusters (Table 2), taken from
the planner as it was before the latency model charged the gradient AllReduce overlapped
with the backward. tests/test_planner_regression.py compares today's plans with it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).resolve().parents[3] / "shared" / "profiles"
CLUSTERS = ("paper-a", "paper-b", "paper-c")
# global batch per model family: DAPPLE Table 4's where it gives one, else 2048 images / 1024 sentences
FAMILY_GBS = {"vgg": 2048, "gnmt": 1024, "bert": 64, "xlnet": 128, "amoeba": 128}
PIPEDREAM_PBS = 64
MAX_LAYERS = 500  # NASNet's graphs (921 and 1251 nodes) take the old planners hours


def cases() -> list[tuple[str, int | None, int]]:
    """(profile path relative to shared/profiles, profile batch size or None, global batch)."""
    out: list[tuple[str, int | None, int]] = []
    for path in sorted((PROFILES / "dapple").glob("*.txt")):
        family = path.name.split("-")[0].replace("vgg16.txt", "vgg")
        gbs = FAMILY_GBS.get(family, FAMILY_GBS.get(family.rstrip("0123456789"), 2048))
        out.append((f"dapple/{path.name}", None if "pbs-" in path.name else 32, gbs))
    for path in sorted((PROFILES / "pipedream").glob("*.graph.txt")):
        gbs = 1024 if path.name.startswith("gnmt") else 2048
        out.append((f"pipedream/{path.name}", PIPEDREAM_PBS, gbs))
    return out


def describe(plan: Any) -> dict[str, Any]:
    return {
        "kind": plan.kind(),
        "micro_batches": plan.micro_batches,
        "stages": [[s.start, s.end, list(s.devices)] for s in plan.stages],
        "latency_ms": plan.predicted.latency_ms if plan.predicted else None,
        "simulated_ms": plan.predicted.simulated_latency_ms if plan.predicted else None,
    }


def record(out: Path) -> list[dict[str, Any]]:
    from lightning_dapple.cluster import load_cluster
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.simulate.plan_and_schedule import make_plan
    from lightning_dapple.profile.loader import load_profile

    rows = []
    for name, pbs, gbs in cases():
        try:
            profile = load_profile(PROFILES / name, profile_batch_size=pbs)
        except DappleConfigError as exc:
            rows.append({"profile": name, "error": str(exc)})
            continue
        if profile.num_layers > MAX_LAYERS:
            rows.append({"profile": name, "skipped": f"{profile.num_layers} layers"})
            continue
        for cluster_name in CLUSTERS:
            row: dict[str, Any] = {"profile": name, "pbs": pbs, "gbs": gbs, "cluster": cluster_name}
            for planner in ("dapple", "pipedream"):
                started = time.perf_counter()
                try:
                    row[planner] = describe(make_plan(profile, load_cluster(cluster_name), gbs, planner=planner))
                except DappleConfigError as exc:
                    row[planner] = {"error": str(exc)}
                row[planner]["seconds"] = round(time.perf_counter() - started, 3)
            print(name, cluster_name, row["dapple"].get("kind"), row["pipedream"].get("kind"), flush=True)
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).with_name("planner_before.json")))
    args = parser.parse_args()
    record(Path(args.out))


if __name__ == "__main__":
    main()
