"""Step time and peak stashed bytes of DAPPLE vs GPipe vs torch.distributed.pipelining vs DDP.

On two CPU ranks (gloo, 127.0.0.1, one thread each) and one 2-stage partition of an MLP
(first half of the blocks on rank 0, second half on rank 1), for each micro-batch count M:

* dapple / gpipe: lightning_dapple's executor (``StageRunner``) with that schedule;
* dapple-ahead: the dapple schedule with receives posted one transfer ahead (an ablation);
* torch-1F1B / torch-GPipe: ``torch.distributed.pipelining`` ``Schedule1F1B`` / ``ScheduleGPipe``;
* ddp: ``DistributedDataParallel`` of the whole model, each rank half of the global batch.

Every variant starts from the same weights; their first-step losses on the same batch must
agree to 1e-5 (asserted). After warm-up, variants run round-robin for ``--steps`` timed
blocks each, a block being ``--block`` consecutive training steps (``dist.barrier`` before
each block, none inside, as in training; ``--block 1`` times isolated steps). A step's
time is the slowest rank's block time over the block's steps, a step being forward +
backward + optimizer step + the step's global-batch loss on every rank (which a Lightning
step needs and lightning_dapple's executor delivers by itself -- torch's schedules and DDP
get it from a broadcast / all-reduce in the same window); the median over blocks is
reported, with the median of per-round ratios (robust to the machine's load drifting) and
the CPU time of both ranks' processes. Peak
stashed bytes come from one extra untimed step per variant, measured identically for all
(``_schedules_worker.LiveStash``); for lightning_dapple ``runner.stats`` is shown too.

    python benchmarks/bench_schedules.py                      # M = 4 and 8, width 1024
    python benchmarks/bench_schedules.py --width 512 --out benchmarks/results/schedules_w512.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

LOSS_TOL = 1e-5


def _rank_main(rank: int, world: int, cfg: dict) -> Any:
    import _schedules_worker  # beside this script; spawned ranks inherit its sys.path

    return _schedules_worker.run(rank, world, cfg)


def summarize(by_rank: dict[int, Any], cfg: dict) -> dict:
    """One record per (M, variant): times from rank 0 (already maxed over ranks), stash per rank."""
    summary: dict[str, Any] = {"config": cfg, "results": {}}
    for m in map(str, cfg["micro_batches"]):
        per = by_rank[0][m]
        base = per["dapple"]["median_s"]
        ref_loss = per["dapple"]["first_loss"]
        rows = {}
        ours = per["dapple"]["times_s"]
        for name, item in per.items():
            # variants run round-robin, so step i of every variant ran in the same round:
            # per-round ratios cancel slow drifts of the machine's load
            paired = sorted(t / d for t, d in zip(item["times_s"], ours))
            ranks = [by_rank[r][m][name] for r in sorted(by_rank)]
            row = {
                "median_step_ms": item["median_s"] * 1e3,
                "ratio_vs_dapple": item["median_s"] / base,
                "paired_ratio_vs_dapple": statistics.median(paired),
                "paired_ratio_quartiles": [paired[len(paired) // 4], paired[(3 * len(paired)) // 4]],
                "min_step_ms": min(item["times_s"]) * 1e3,
                "step_ms": [t * 1e3 for t in item["times_s"]],
                "median_cpu_ms": item["median_cpu_s"] * 1e3,
                "cpu_ms": [t * 1e3 for t in item["cpu_s"]],
                "first_step_ms": item["first_step_s"] * 1e3,
                "first_loss": item["first_loss"],
                "first_loss_diff_vs_dapple": abs(item["first_loss"] - ref_loss),
                "second_loss": item["second_loss"],
                "second_loss_diff_vs_dapple": abs(item["second_loss"] - per["dapple"]["second_loss"]),
                "peak_stash_bytes_per_rank": [r["peak_stash_bytes"] for r in ranks],
                "peak_stash_bytes": max(r["peak_stash_bytes"] for r in ranks),
                "peak_stash_view_bytes_per_rank": [r["peak_stash_view_bytes"] for r in ranks],
                "peak_stash_view_bytes": max(r["peak_stash_view_bytes"] for r in ranks),
                "leftover_stash_bytes_per_rank": [r["leftover_bytes"] for r in ranks],
            }
            if "runner_peak_stash_bytes" in item:
                row["runner_peak_stash_bytes_per_rank"] = [r["runner_peak_stash_bytes"] for r in ranks]
                row["runner_peak_stash_bytes"] = max(row["runner_peak_stash_bytes_per_rank"])
                row["runner_peak_in_flight_per_rank"] = [r["runner_peak_in_flight"] for r in ranks]
            rows[name] = row
        summary["results"][m] = rows
    return summary


def print_table(summary: dict) -> None:
    from lightning_dapple.plan.console import make_console
    from rich.table import Table

    cfg = summary["config"]
    table = Table(
        title=(
            f"2-stage MLP, {cfg['layers']} x Linear({cfg['width']})+ReLU, global batch {cfg['batch']}, "
            f"{cfg['steps']} timed blocks of {cfg['block']} steps (median per step), 2 gloo ranks x 1 thread"
        )
    )
    for col, justify in [
        ("variant", "left"), ("M", "right"), ("median step ms", "right"), ("ratio vs dapple", "right"),
        ("paired ratio [IQR]", "right"), ("CPU ms (2 ranks)", "right"),
        ("peak stashed MB storages (r0 / r1)", "right"), ("views (r0 / r1)", "right"),
        ("runner.stats MB (r0 / r1)", "right"),
        ("step-0 loss", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    mb = 1 / 2**20
    for m, rows in summary["results"].items():
        for name, row in rows.items():
            runner = row.get("runner_peak_stash_bytes_per_rank")
            table.add_row(
                name,
                m,
                f"{row['median_step_ms']:.1f}",
                f"{row['ratio_vs_dapple']:.3f}",
                f"{row['paired_ratio_vs_dapple']:.2f} [{row['paired_ratio_quartiles'][0]:.2f}-{row['paired_ratio_quartiles'][1]:.2f}]",
                f"{row['median_cpu_ms']:.1f}",
                " / ".join(f"{b * mb:.2f}" for b in row["peak_stash_bytes_per_rank"]),
                " / ".join(f"{b * mb:.2f}" for b in row["peak_stash_view_bytes_per_rank"]),
                " / ".join(f"{b * mb:.2f}" for b in runner) if runner else "-",
                f"{row['first_loss']:.7f}",
            )
        table.add_section()
    make_console().print(table)


def print_verdict(summary: dict) -> None:
    """The issue's acceptance: the dapple schedule no slower than torch's Schedule1F1B."""
    for m, rows in summary["results"].items():
        ours, theirs = rows["dapple"], rows["torch-1F1B"]
        ratio = ours["median_step_ms"] / theirs["median_step_ms"]
        paired = 1 / theirs["paired_ratio_vs_dapple"]
        cpu = ours["median_cpu_ms"] / theirs["median_cpu_ms"]
        verdict = "no slower" if ratio <= 1.0 else "SLOWER"
        print(
            f"M={m}: dapple {ours['median_step_ms']:.1f} ms vs torch-1F1B {theirs['median_step_ms']:.1f} ms "
            f"(dapple/1F1B {ratio:.3f}: {verdict}; per-round paired {paired:.3f}); CPU time dapple/1F1B {cpu:.3f}"
        )


def check_stash(summary: dict) -> None:
    """The same schedule must stash the same bytes whoever runs it (a check of the meter)."""
    for m, rows in summary["results"].items():
        for ours, theirs in (("dapple", "torch-1F1B"), ("gpipe", "torch-GPipe")):
            a, b = rows[ours]["peak_stash_view_bytes_per_rank"], rows[theirs]["peak_stash_view_bytes_per_rank"]
            verdict = "same" if a == b else "DIFFERENT"
            print(f"M={m}: peak stashed bytes per rank (views) {ours} {a} vs {theirs} {b}: {verdict}")


def check_losses(summary: dict) -> None:
    for m, rows in summary["results"].items():
        worst = max(row["first_loss_diff_vs_dapple"] for row in rows.values())
        second = max(row["second_loss_diff_vs_dapple"] for row in rows.values())
        print(
            f"M={m}: first-step loss {rows['dapple']['first_loss']:.8f}, max |diff| across variants {worst:.2e} "
            f"(tol {LOSS_TOL:g}); after one SGD step: max |diff| {second:.2e}"
        )
        for name, row in rows.items():
            assert row["first_loss_diff_vs_dapple"] <= LOSS_TOL, (
                f"M={m}: first-step loss of {name} ({row['first_loss']!r}) differs from dapple's "
                f"({rows['dapple']['first_loss']!r}) by {row['first_loss_diff_vs_dapple']:.3e}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25, help="timed blocks per variant (median reported; >= 7)")
    parser.add_argument("--block", type=int, default=8, help="consecutive training steps per timed block (1: isolated steps)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant after the first (>= 1)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="values of M")
    parser.add_argument("--width", type=int, default=1024, help="Linear width")
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks (split in half over 2 stages)")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is abandoned")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "schedules.json", help="JSON results path")
    args = parser.parse_args(argv)
    if args.steps < 7:
        parser.error("--steps must be at least 7")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if args.block < 1:
        parser.error("--block must be at least 1")
    if args.layers < 2 or args.layers % 2:
        parser.error("--layers must be an even number >= 2")
    if args.batch % 2:
        parser.error("--batch must be even (DDP gives each of the 2 ranks half)")
    for m in args.micro_batches:
        if m < 2 or args.batch % m:
            parser.error(f"M={m}: need M >= 2 (Schedule1F1B wants M >= stages) dividing --batch into equal micro-batches")
    cfg = {
        "steps": args.steps, "block": args.block, "warmup": args.warmup, "micro_batches": args.micro_batches, "width": args.width,
        "layers": args.layers, "batch": args.batch, "timeout": args.timeout,
    }
    started, load_before = time.perf_counter(), os.getloadavg()
    by_rank = run_ranks(_rank_main, 2, cfg, timeout_s=cfg["timeout"], raise_on_error=True)
    summary = summarize(by_rank, cfg)
    summary["wall_s"] = time.perf_counter() - started
    # other processes on the machine skew step times: keep the load next to the numbers
    summary["load_average_1m"] = {"before": load_before[0], "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    import torch

    summary["torch"] = torch.__version__
    print_table(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    load = summary["load_average_1m"]
    print(
        f"results written to {args.out} ({summary['wall_s']:.0f} s; 1-min load average {load['before']:.1f} -> "
        f"{load['after']:.1f} on {load['cpus']} CPUs)"
    )
    print_verdict(summary)
    check_stash(summary)
    check_losses(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
