"""Step time and peak stashed bytes of DAPPLE vs GPipe vs torch.distributed.pipelining vs DDP.

Two modes. By default (``--ranks 2``), on two CPU ranks (gloo, 127.0.0.1, one thread
each) and one 2-stage partition of an MLP (first half of the blocks on rank 0, second half
on rank 1), for each micro-batch count M:

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

With ``--ranks P --chunks 2`` (P >= 2), the chunked schedules on P ranks holding 2 stages
each, 2P stages of equal blocks: lightning_dapple's ``interleaved`` and ``zbv`` against
``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble`` with the same placements, and
``dapple`` against ``Schedule1F1B`` (P stages) as the 1F1B reference. Besides the losses,
every variant's parameters after the first step must match one SGD step of the whole model
in one process. Reported per pair: ours / torch's step time (median, and median of
per-round ratios) and peak stashed bytes per rank. Ours run each chunked schedule under the
K_i policy the planner's simulation chooses for these stages (``planner_policies``: both
simulated, the faster kept); ``--policy-ablation`` adds ``interleaved`` under the other one.
``--settle-ablation`` adds
``interleaved-nosettle`` and ``zbv-nosettle``: the same schedules with every send waited at
the end of the step instead of as soon as its receiver is known to have it
(``schedule.settle.group_settle_points``); reported: the step-time ratio to them and the
peak bytes of sends not yet waited per rank (``_send_probe``).

    python benchmarks/bench_schedules.py                      # M = 4 and 8, width 1024
    python benchmarks/bench_schedules.py --width 512 --out benchmarks/results/schedules_w512.json
    python benchmarks/bench_schedules.py --ranks 4 --chunks 2  # M = 8, width 1024, 16 blocks, batch 256
    python benchmarks/bench_schedules.py --ranks 4 --chunks 2 --settle-ablation --out benchmarks/results/schedules_settle.json
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
# after one step, |parameter - one process's| may be a rounding of p - lr * g (an ulp of the
# largest parameter) plus float32 sums of g in another order (a few ulps of the update); a
# gradient off by a factor (e.g. not divided by M) differs by a large fraction of the update
PARAM_TOL = 1e-4  # of the largest parameter change of the step, plus FLOAT32_EPS of the largest parameter
FLOAT32_EPS = 2.0**-23
# (ours, torch's) run the same schedule; in the chunked mode the acceptance compares them
PAIRS = {
    1: (("dapple", "torch-1F1B"), ("gpipe", "torch-GPipe")),
    2: (("interleaved", "torch-Interleaved1F1B"), ("zbv", "torch-ZBVZeroBubble"), ("dapple", "torch-1F1B")),
}
# chunked mode: the most each of ours may take of torch's step time on the same schedule:
# no slower (with a core per rank, --ranks 2; the 1F1B reference too)
TARGET_RATIO = {"interleaved": 1.0, "zbv": 1.0, "dapple": 1.0}
# per mode: defaults of the options that differ. Chunked: 16 blocks make 8 stages of 2; at
# width 1024 and 32 rows per micro-batch the matrix products take most of a step's CPU time
# (not so at width 512: benchmarks/README.md), and 15 blocks of 4 steps of 6 variants take
# a few minutes on 2 cores
DEFAULTS = {
    1: {"steps": 25, "block": 8, "micro_batches": [4, 8], "width": 1024, "layers": 8, "batch": 64, "out": HERE / "results" / "schedules.json"},
    2: {"steps": 15, "block": 4, "micro_batches": [8], "width": 1024, "layers": 16, "batch": 256, "out": HERE / "results" / "schedules_chunked.json"},
}


def planner_policies(cfg: dict) -> dict[str, dict[str, Any]]:
    """Per M, the K_i policy each chunked schedule runs with here, chosen as ``plan="auto"``
    chooses it: both policies are simulated on the model's profile (one micro-batch, one
    thread, as a rank runs it) and this machine's cluster as the strategy detects it, and the
    faster is kept, P_A on a tie (``plan/schedule_choice.py``, DAPPLE 5.3). The run's
    planner also prices the executor's time per action and the links it measures, which
    this choice leaves out. torch's Interleaved1F1B runs Megatron's warm-up count, our P_B."""
    import torch
    from torch import nn

    from _schedules_worker import make_blocks, stage_layers, stage_ranks
    from lightning_dapple.cluster import detect_cluster
    from lightning_dapple.plan.plan import POLICIES, plan_from_dict
    from lightning_dapple.profile.profiler import profile_layers
    from lightning_dapple.simulate.plan_and_schedule import simulate_plan

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cluster = detect_cluster(1, cfg["ranks"], "cpu")
        cuts = stage_layers(cfg["layers"], cfg["ranks"] * cfg["chunks"])
        out: dict[str, dict[str, Any]] = {}
        for m in cfg["micro_batches"]:
            torch.manual_seed(0)
            blocks = nn.Sequential(*make_blocks(cfg["width"], cfg["layers"]))
            profile = profile_layers(blocks, torch.randn(cfg["batch"] // m, cfg["width"]), repeats=5, warmup=2)
            chosen: dict[str, Any] = {}
            for schedule, placement in (("interleaved", "interleaved"), ("zbv", "v")):
                where = stage_ranks(placement, cfg["ranks"], cfg["chunks"])
                simulated = {}
                for policy in POLICIES:
                    plan = plan_from_dict(
                        {
                            "global_batch_size": cfg["batch"], "micro_batches": m, "schedule": schedule, "policy": policy,
                            "stages": [{"layers": list(cut), "devices": [rank]} for cut, rank in zip(cuts, where)],
                        }
                    )
                    simulated[policy] = simulate_plan(plan, profile, cluster).latency_ms
                best = min(POLICIES, key=lambda policy: (simulated[policy], POLICIES.index(policy)))
                chosen[schedule] = {"policy": best, "simulated_ms": simulated}
            out[str(m)] = chosen
        return out
    finally:
        torch.set_num_threads(threads)


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
                "blocks_per_rank": [r["blocks"] for r in ranks],
            }
            if "param_diff_after_one_step" in item:
                row["param_diff_after_one_step"] = item["param_diff_after_one_step"]
                row["largest_param_change"] = item["largest_param_change"]
                row["param_tolerance"] = PARAM_TOL * item["largest_param_change"] + FLOAT32_EPS * item["largest_param"]
            if "runner_peak_stash_bytes" in item:
                row["runner_peak_stash_bytes_per_rank"] = [r["runner_peak_stash_bytes"] for r in ranks]
                row["runner_peak_stash_bytes"] = max(row["runner_peak_stash_bytes_per_rank"])
                row["runner_peak_in_flight_per_rank"] = [r["runner_peak_in_flight"] for r in ranks]
                row["runner_peak_send_bytes_per_rank"] = [r["runner_peak_send_bytes"] for r in ranks]
            rows[name] = row
        summary["results"][m] = rows
    summary["pairs"] = {m: compare_pairs(by_rank[0][m], rows, cfg, m) for m, rows in summary["results"].items()}
    if cfg.get("settle_ablation"):
        summary["settle"] = {m: compare_settle(by_rank[0][m], rows) for m, rows in summary["results"].items()}
    return summary


def compare_settle(per: dict, rows: dict) -> dict:
    """Each chunked schedule with its sends waited at their settle points against the same
    schedule waiting for every send at the end of the step: step-time ratios (median, and
    median of per-round ratios) and per rank the peak bytes of sends pending and of stash."""
    out = {}
    for name in ("interleaved", "zbv"):
        ablation = f"{name}-nosettle"
        paired = sorted(a / b for a, b in zip(per[name]["times_s"], per[ablation]["times_s"]))
        out[f"{name}/{ablation}"] = {
            "ratio": per[name]["median_s"] / per[ablation]["median_s"],
            "paired_ratio": statistics.median(paired),
            "paired_ratio_quartiles": [paired[len(paired) // 4], paired[(3 * len(paired)) // 4]],
            "cpu_ratio": per[name]["median_cpu_s"] / per[ablation]["median_cpu_s"],
            "send_bytes_per_rank": {key: rows[key]["runner_peak_send_bytes_per_rank"] for key in (name, ablation)},
            "runner_stash_bytes_per_rank": {key: rows[key]["runner_peak_stash_bytes_per_rank"] for key in (name, ablation)},
        }
    return out


def other_policy_name(cfg: dict, m: str) -> str:
    """The ``--policy-ablation`` variant: interleaved under the policy ``planner_policies`` did not choose."""
    chosen = cfg["policies"][m]["interleaved"]["policy"]
    return "interleaved-" + ("PB" if chosen == "PA" else "PA")


def compare_pairs(per: dict, rows: dict, cfg: dict, m: str) -> dict:
    """Ours against torch's on the same schedule: step-time ratios, and peak stashed bytes
    per rank counted by distinct views (a micro-batch slice counts its rows, as the stash
    rule of ``lightning_dapple.profile.stash`` does; ``check_stash`` uses the same count)."""
    pairs = {}
    extra = ((other_policy_name(cfg, m), "torch-Interleaved1F1B"),) if cfg.get("policy_ablation") else ()
    if cfg.get("due_ablation"):
        extra += (("interleaved-due", "torch-Interleaved1F1B"), ("zbv-due", "torch-ZBVZeroBubble"))
    for ours, theirs in (*PAIRS[cfg["chunks"]], *extra):
        paired = sorted(a / b for a, b in zip(per[ours]["times_s"], per[theirs]["times_s"]))
        a, b = rows[ours]["peak_stash_view_bytes_per_rank"], rows[theirs]["peak_stash_view_bytes_per_rank"]
        pairs[f"{ours}/{theirs}"] = {
            "ratio": per[ours]["median_s"] / per[theirs]["median_s"],
            "target_ratio": TARGET_RATIO.get(ours, 1.0),
            "paired_ratio": statistics.median(paired),
            "paired_ratio_quartiles": [paired[len(paired) // 4], paired[(3 * len(paired)) // 4]],
            "cpu_ratio": per[ours]["median_cpu_s"] / per[theirs]["median_cpu_s"],
            "stash_bytes_per_rank": {ours: a, theirs: b},
            "stash_same_or_less": all(x <= y for x, y in zip(a, b)),
        }
    return pairs


def print_table(summary: dict) -> None:
    from lightning_dapple.plan.console import make_console
    from rich.table import Table

    cfg = summary["config"]
    ranks = cfg["ranks"]
    shape = "2-stage MLP" if cfg["chunks"] == 1 else f"{ranks * cfg['chunks']}-stage MLP ({cfg['chunks']} stages per rank; dapple 1)"
    table = Table(
        title=(
            f"{shape}, {cfg['layers']} x Linear({cfg['width']})+ReLU, global batch {cfg['batch']}, "
            f"{cfg['steps']} timed blocks of {cfg['block']} steps (median per step), {ranks} gloo ranks x 1 thread"
        )
    )
    names = " / ".join(f"r{r}" for r in range(ranks))
    for col, justify in [
        ("variant", "left"), ("M", "right"), ("median step ms", "right"), ("ratio vs dapple", "right"),
        ("paired ratio [IQR]", "right"), (f"CPU ms ({ranks} ranks)", "right"),
        (f"peak stashed MB storages ({names})", "right"), (f"views ({names})", "right"),
        (f"runner.stats MB ({names})", "right"), (f"sends pending MB ({names})", "right"),
        ("step-0 loss", "right"),
    ]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    mb = 1 / 2**20
    for m, rows in summary["results"].items():
        for name, row in rows.items():
            runner = row.get("runner_peak_stash_bytes_per_rank")
            sends = row.get("runner_peak_send_bytes_per_rank")
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
                " / ".join(f"{b * mb:.2f}" for b in sends) if sends else "-",
                f"{row['first_loss']:.7f}",
            )
        table.add_section()
    make_console().print(table)


def print_verdict(summary: dict) -> None:
    """The acceptance: the dapple schedule no slower than torch's Schedule1F1B (2 ranks);
    each chunked schedule at most ``TARGET_RATIO`` of torch's, stashing no more per rank."""
    if summary["config"]["chunks"] > 1:
        print_chunked_verdict(summary)
        return
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


def print_chunked_verdict(summary: dict) -> None:
    mb = 1 / 2**20
    for m, chosen in summary["config"].get("policies", {}).items():
        for schedule, item in chosen.items():
            tried = ", ".join(f"{policy} {ms:.1f} ms" for policy, ms in item["simulated_ms"].items())
            print(f"M={m}: {schedule} runs K_i policy {item['policy']}, the faster simulated (simulated {tried})")
    for m, pairs in summary["pairs"].items():
        for name, pair in pairs.items():
            ours, theirs = name.split("/")
            target = pair["target_ratio"]
            verdict = "meets" if pair["ratio"] <= target and pair["paired_ratio"] <= target else "MISSES"
            stash = pair["stash_bytes_per_rank"]
            print(
                f"M={m}: {ours}/{theirs} step time {pair['ratio']:.3f} (per-round paired {pair['paired_ratio']:.3f} "
                f"[{pair['paired_ratio_quartiles'][0]:.2f}-{pair['paired_ratio_quartiles'][1]:.2f}]; {verdict} <= {target}); "
                f"CPU time {pair['cpu_ratio']:.3f}; peak stashed MB per rank (views) "
                f"{' / '.join(f'{b * mb:.2f}' for b in stash[ours])} vs {' / '.join(f'{b * mb:.2f}' for b in stash[theirs])}: "
                f"{'same or less' if pair['stash_same_or_less'] else 'MORE'}"
            )


def print_settle(summary: dict) -> None:
    """``--settle-ablation``: sends waited at their settle points against at the end of the step."""
    mb = 1 / 2**20
    for m, pairs in summary.get("settle", {}).items():
        for name, pair in pairs.items():
            ours, ablation = name.split("/")
            sends, stash = pair["send_bytes_per_rank"], pair["runner_stash_bytes_per_rank"]
            print(
                f"M={m}: {ours}/{ablation} step time {pair['ratio']:.3f} (per-round paired {pair['paired_ratio']:.3f} "
                f"[{pair['paired_ratio_quartiles'][0]:.2f}-{pair['paired_ratio_quartiles'][1]:.2f}]); CPU time {pair['cpu_ratio']:.3f}; "
                f"peak MB of sends pending per rank {' / '.join(f'{b * mb:.2f}' for b in sends[ours])} vs "
                f"{' / '.join(f'{b * mb:.2f}' for b in sends[ablation])}; runner.stats stash {' / '.join(f'{b * mb:.2f}' for b in stash[ours])}"
            )


def check_stash(summary: dict) -> None:
    """The same schedule must stash the same bytes whoever runs it (a check of the meter)."""
    same_schedule = PAIRS[summary["config"]["chunks"]] if summary["config"]["chunks"] == 1 else (("dapple", "torch-1F1B"),)
    for m, rows in summary["results"].items():
        for ours, theirs in same_schedule:
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


def check_parameters(summary: dict) -> None:
    """Chunked mode: after one step, every variant's parameters are one process's."""
    for m, rows in summary["results"].items():
        change, tol = rows["dapple"]["largest_param_change"], rows["dapple"]["param_tolerance"]
        worst = max(row["param_diff_after_one_step"] for row in rows.values())
        print(
            f"M={m}: after one step, max |parameter - single process| across variants {worst:.2e} "
            f"(tol {tol:.2e}; largest change of the step {change:.2e})"
        )
        for name, row in rows.items():
            assert row["param_diff_after_one_step"] <= tol, (
                f"M={m}: after one step the parameters of {name} differ from one process's by "
                f"{row['param_diff_after_one_step']:.3e}, over {tol:.3e} (the step changed them by up to {change:.3e})"
            )


def parse_config(argv: list[str] | None) -> tuple[dict, Path]:
    """The run's configuration (the mode's defaults where an option is not given) and its
    JSON path; bad values are refused here, before any rank starts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks (processes); 2 unless --chunks 2")
    parser.add_argument("--chunks", type=int, default=1, choices=(1, 2), help="stages per rank: 1 (2 ranks) or 2 (chunked schedules)")
    parser.add_argument("--steps", type=int, help="timed blocks per variant (median reported; >= 7; default 25; chunked: 15)")
    parser.add_argument("--block", type=int, help="consecutive training steps per timed block (1: isolated steps; default 8; chunked: 4)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant after the first (>= 1)")
    parser.add_argument("--micro-batches", type=int, nargs="+", help="values of M (default 4 8; chunked: 8)")
    parser.add_argument("--width", type=int, help="Linear width (default 1024)")
    parser.add_argument("--layers", type=int, help="Linear+ReLU blocks, cut equally over the stages (default 8; chunked: 16)")
    parser.add_argument("--batch", type=int, help="global batch size (default 64; chunked: 256)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is abandoned")
    parser.add_argument("--out", type=Path, help="JSON results path (default results/schedules.json; chunked: results/schedules_chunked.json)")
    parser.add_argument("--policy-ablation", action="store_true", help="chunked: also run interleaved under the K_i policy the planner did not choose")
    parser.add_argument("--due-ablation", action="store_true", help="chunked: also run interleaved and zbv with every receive posted when due, never ahead")
    parser.add_argument("--settle-ablation", action="store_true", help="chunked: also run interleaved and zbv with every send waited at the end of the step")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.chunks].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 7:
        parser.error("--steps must be at least 7")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if args.block < 1:
        parser.error("--block must be at least 1")
    if args.chunks == 1 and args.ranks != 2:
        parser.error("--ranks must be 2 with one stage per rank; give --chunks 2 for more ranks")
    if args.ranks < 2:
        parser.error("--ranks must be at least 2")
    if args.settle_ablation and args.chunks == 1:
        parser.error("--settle-ablation needs --chunks 2 (it compares the chunked schedules' settle points)")
    if args.due_ablation and args.chunks == 1:
        parser.error("--due-ablation needs --chunks 2 (the 2-rank mode runs dapple-ahead already)")
    if args.policy_ablation and args.chunks == 1:
        parser.error("--policy-ablation needs --chunks 2 (it runs the interleaved schedule under the other K_i policy)")
    stages = args.ranks * args.chunks
    if args.layers < stages or args.layers % stages:
        parser.error(f"--layers must be a positive multiple of the {stages} stages")
    if args.chunks == 1 and args.batch % 2:
        parser.error("--batch must be even (DDP gives each of the 2 ranks half)")
    for m in args.micro_batches:
        if m < args.ranks or args.batch % m:
            parser.error(f"M={m}: need M >= {args.ranks} (torch's schedules want M >= ranks) dividing --batch into equal micro-batches")
    cfg = {
        "steps": args.steps, "block": args.block, "warmup": args.warmup, "micro_batches": args.micro_batches, "width": args.width,
        "layers": args.layers, "batch": args.batch, "timeout": args.timeout, "ranks": args.ranks, "chunks": args.chunks,
        "settle_ablation": args.settle_ablation, "policy_ablation": args.policy_ablation,
        "due_ablation": args.due_ablation,
    }
    return cfg, args.out


def main(argv: list[str] | None = None) -> int:
    cfg, out = parse_config(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    if cfg["chunks"] > 1:
        cfg["policies"] = planner_policies(cfg)
    by_rank = run_ranks(_rank_main, cfg["ranks"], cfg, timeout_s=cfg["timeout"], raise_on_error=True)
    summary = summarize(by_rank, cfg)
    summary["wall_s"] = time.perf_counter() - started
    # other processes on the machine skew step times: keep the load next to the numbers
    summary["load_average_1m"] = {"before": load_before[0], "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    import torch

    summary["torch"] = torch.__version__
    print_table(summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    load = summary["load_average_1m"]
    print(
        f"results written to {out} ({summary['wall_s']:.0f} s; 1-min load average {load['before']:.1f} -> "
        f"{load['after']:.1f} on {load['cpus']} CPUs)"
    )
    print_verdict(summary)
    print_settle(summary)
    check_stash(summary)
    check_losses(summary)
    if cfg["chunks"] > 1:
        check_parameters(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
