"""``dapple-simulate``: run a plan's schedule through the discrete-event simulator.

The planner's latency formula (DAPPLE 4.1, formulas 1-2) is an approximation that ignores
bubbles inside the pivot stage; this command shows what the schedule actually does with the
same costs: per-stage times, the micro-batches each stage holds at once (K_i under DAPPLE's
early backward, 5.3; M under GPipe) and the resulting step latency and bubble fraction.

    dapple-simulate --profile bert-48-pbs-2.txt --plan plan.json --cluster paper-a \\
        [--schedule dapple|gpipe] [--profile-batch-size N] [--json] [--png timeline.png]

``--json`` prints only the result's JSON. Bad input prints one ``error: ...`` line on
stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.costs import dapple_latency
from lightning_dapple.plan.plan import Plan, SCHEDULES, load_plan
from lightning_dapple.profile.model_profile import load_profile
from lightning_dapple.simulate.engine import ScheduleDeadlock, SimulationResult, simulate_plan

__all__ = ["build_parser", "main", "print_result"]

MB = 1024**2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapple-simulate",
        description="Simulate one training step of a DAPPLE/GPipe plan (latency, bubbles, peak stash per stage).",
    )
    parser.add_argument("--profile", required=True, help="profile JSON or PipeDream graph text file")
    parser.add_argument("--plan", required=True, help="plan JSON (written by dapple-plan or by hand)")
    parser.add_argument("--cluster", required=True, help="preset (paper-a/b/c), 'MACHINESxDEVICES', or a cluster JSON/YAML file")
    parser.add_argument("--schedule", choices=SCHEDULES, default=None, help="override the plan's schedule")
    parser.add_argument("--profile-batch-size", type=int, default=None, help="batch size the profile was measured at (graph text files)")
    parser.add_argument("--json", action="store_true", help="print only the result as JSON")
    parser.add_argument("--png", default=None, help="also draw the device timelines to this PNG file")
    return parser


def _error(message: str) -> int:
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    try:
        if args.profile_batch_size is not None and args.profile_batch_size <= 0:
            raise DappleConfigError("--profile-batch-size", f"is {args.profile_batch_size}", "give a positive number of samples")
        profile = load_profile(args.profile, profile_batch_size=args.profile_batch_size)
        plan = load_plan(args.plan)
        cluster = load_cluster(args.cluster)
        result = simulate_plan(plan, profile, cluster, schedule=args.schedule)
        if args.png:
            from lightning_dapple.simulate.timeline_png import draw_timeline

            draw_timeline(result, args.png, title=f"{profile.name}: {args.schedule or plan.schedule}, M={plan.micro_batches}")
    except (DappleConfigError, ScheduleDeadlock) as exc:
        return _error(str(exc))
    except OSError as exc:
        name = getattr(exc, "filename", None)
        return _error(f"cannot access {name!r}: {exc.strerror or exc}" if name else str(exc))
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print_result(result, plan)
        if args.png:
            print(f"wrote {args.png}")
    return 0


def print_result(result: SimulationResult, plan: Plan) -> None:
    """A rich table per stage, then latency, bubble fraction and the planner formula's estimate."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result.schedule} schedule, M = {result.micro_batches}")
    # K_i: warm-up forwards (5.3); F/B: per micro-batch slice on one device; send: one
    # boundary to the next stage; AR: gradient AllReduce; peak: micro-batches in flight.
    for name in ("stage", "layers", "devices", "K_i", "F ms", "B ms", "send ms", "AR ms", "peak", "stash MB", "busy %"):
        table.add_column(name, justify="left" if name in ("layers", "devices") else "right", no_wrap=True)
    for stage_result, stage in zip(result.stages, plan.stages):
        cost = stage_result.cost
        devices = ",".join(str(d) for d in stage_result.devices)
        table.add_row(
            str(stage_result.stage),
            f"[{stage.start}, {stage.end})",
            devices if len(devices) <= 24 else f"{stage_result.devices[0]}..{stage_result.devices[-1]} ({len(stage_result.devices)})",
            str(stage_result.warmup),
            f"{cost.forward_ms:.2f}",
            f"{cost.backward_ms:.2f}",
            f"{cost.send_ms:.2f}",
            f"{cost.allreduce_ms:.2f}",
            str(stage_result.peak_in_flight),
            f"{stage_result.peak_stash_bytes / MB:.1f}",
            f"{100 * stage_result.busy_fraction(result.latency_ms):.1f}",
        )
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 110)
    console.print(table)
    console.print(f"latency: {result.latency_ms:.3f} ms per step")
    console.print(f"bubble fraction: {result.bubble_fraction:.4f} (AllReduce and waiting count as idle)")
    costs = [stage.cost for stage in result.stages]
    estimate = dapple_latency(costs, result.micro_batches)
    gap = (estimate.latency_ms - result.latency_ms) / result.latency_ms if result.latency_ms > 0 else 0.0
    console.print(
        f"planner formula (DAPPLE 4.1): {estimate.latency_ms:.3f} ms, pivot stage {estimate.pivot_stage} "
        f"({100 * gap:+.1f}% vs simulated)"
    )


if __name__ == "__main__":
    sys.exit(main())
