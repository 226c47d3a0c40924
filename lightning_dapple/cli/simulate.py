"""dapple-simulate: run a plan's schedule through the discrete-event simulator.

The planner's latency formula (DAPPLE 4.1, formulas 1-2) is an approximation that ignores
bubbles inside the pivot stage; this command shows what the schedule actually does with the
same costs: per-stage times, the micro-batches each stage holds at once (K_i under DAPPLE's
early backward, 5.3; M under GPipe), the step latency and the bubble fraction.

--schedule names the schedule to run the plan under, or auto: the plan's devices and M
under the fastest simulated schedule that fits, chosen as dapple-plan and
DappleStrategy(schedule="auto") choose it. --ooo true runs the plan with out-of-order
backprop (ooo-backprop 3, 5.1-5.2: B before W, deferred W filling bubbles, per-layer ending
with bucketed AllReduce) and prints the difference to the plan without it; --ooo auto
turns it on where the simulator says it is faster, as DappleStrategy(ooo="auto") does.
--recompute sets every stage's recomputation (auto: the cheapest setting per stage that
fits device memory, --memory-gib or the cluster's); the table then shows each stage's
choice and its peak stash.

--json prints only the result's JSON. Bad input prints one "error: ..." line on stderr and
exits with status 2.

Examples:
  dapple-simulate --profile bert-48-pbs-2.txt --plan plan.json --cluster paper-a
  dapple-simulate --recipe bert --plan plan.json --cluster paper-a --schedule auto --ooo auto
  dapple-simulate --recipe gnmt --plan plan.json --cluster paper-b --schedule gpipe --png timeline.png
  dapple-simulate --profile profile.json --plan plan.json --cluster 1x4 --ooo --recompute auto --memory-gib 8 --json
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace as _replace
from typing import Any, Sequence

from rich.table import Table

from lightning_dapple.app.recipe_profile import recipe_profile
from lightning_dapple.cli.common import CLUSTER_HELP, ArgumentError, add_ooo, ooo_finisher, ooo_setting, parser_from_doc
from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.costs import dapple_latency
from lightning_dapple.plan.plan import SCHEDULES, Plan, load_plan
from lightning_dapple.plan.schedule_choice import AUTO_SCHEDULE, RUNNABLE_SCHEDULES, choose_schedule
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate.engine import ScheduleDeadlock, SimulationResult
from lightning_dapple.simulate.memory_fit import apply_ooo_recompute
from lightning_dapple.simulate.plan_and_schedule import check_plan_fits, price_plan, simulate_plan
from lightning_dapple.simulate.timeline_png import draw_timeline
from lightning_dapple.strategy.ooo_choice import decide_ooo, with_ooo_choice

__all__ = ["build_parser", "main", "print_result"]

MB = 1024**2


def build_parser() -> argparse.ArgumentParser:
    parser = parser_from_doc("dapple-simulate", __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", metavar="FILE", help="a profile JSON (dapple-profile --out) or a PipeDream graph text file")
    source.add_argument("--recipe", metavar="NAME", help="a recipe's full-size model, its profile estimated for --device: bert, gnmt or vgg")
    parser.add_argument("--plan", required=True, metavar="FILE", help="plan JSON (written by dapple-plan --out, or by hand: docs/formats.md)")
    parser.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    parser.add_argument(
        "--schedule", choices=(AUTO_SCHEDULE, *SCHEDULES), default=None,
        help="run the plan under this schedule; auto: the fastest simulated schedule that fits the plan's devices and M "
        "(plan/schedule_choice.py, as dapple-plan chooses); default: the plan's",
    )
    add_ooo(parser, "default: the plan's")
    parser.add_argument(
        "--recompute",
        choices=("never", "always", "except_last", "auto"),
        default=None,
        help="recomputation of every stage (auto: the cheapest per stage that fits device memory); default: the plan's",
    )
    parser.add_argument("--memory-gib", type=float, default=None, metavar="GIB", help="device memory budget for --recompute auto (default: the cluster's)")
    parser.add_argument("--profile-batch-size", type=int, default=None, metavar="N", help="batch size the profile was measured at (graph text files)")
    parser.add_argument(
        "--activation-bytes-per-sample", type=float, default=None, metavar="BYTES",
        help="measured peak activation memory of one sample (as for dapple-plan; 0: the layer outputs the file lists)",
    )
    parser.add_argument("--device", default="V100", help="with --recipe: the device the profile is estimated for: V100, A100 or H100 (default: V100)")
    parser.add_argument("--json", action="store_true", help="print only the result as JSON")
    parser.add_argument("--png", default=None, metavar="FILE", help="also draw the device timelines to this PNG file")
    return parser


def _error(message: str) -> int:
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(None if argv is None else list(argv))
        if args.profile_batch_size is not None and args.profile_batch_size <= 0:
            raise DappleConfigError("--profile-batch-size", f"is {args.profile_batch_size}", "give a positive number of samples")
        if args.memory_gib is not None and args.memory_gib <= 0:
            raise DappleConfigError("--memory-gib", f"is {args.memory_gib}", "give a positive number of GiB")
        profile = recipe_profile(args.recipe, device=args.device) if args.recipe else load_profile(args.profile, args.profile_batch_size, args.activation_bytes_per_sample)
        plan = load_plan(args.plan)
        cluster = load_cluster(args.cluster)
        plan, result, baseline = _simulate(args, plan, profile, cluster)
        if args.png:
            draw_timeline(result, args.png, title=f"{profile.name}: {result.schedule}, M={plan.micro_batches}")
    except (ArgumentError, DappleConfigError, ScheduleDeadlock) as exc:
        return _error(str(exc))
    except OSError as exc:
        name = getattr(exc, "filename", None)
        return _error(f"cannot access {name!r}: {exc.strerror or exc}" if name else str(exc))
    _report(args, plan, result, baseline)
    return 0


def _simulate(args: argparse.Namespace, plan: Plan, profile: Any, cluster: Any) -> tuple[Plan, SimulationResult, SimulationResult | None]:
    """(the plan as simulated, its result, the same plan without ooo when --ooo asked for it)."""
    setting = ooo_setting(args.ooo)
    schedule = args.schedule
    if schedule == AUTO_SCHEDULE:  # the planner's choice, each candidate finished with the --ooo setting
        if plan.chunks > 1:
            raise DappleConfigError(
                "--schedule", f"is auto but the plan runs {plan.chunks} stages per device group (its schedule {plan.schedule!r} was chosen already)",
                "give a plan with one stage per device group (dapple-plan --schedule dapple --out FILE), or name the schedule",
            )
        plan = choose_schedule(plan, profile, cluster, price_plan, RUNNABLE_SCHEDULES, ooo_finisher(setting, profile, cluster))
        schedule = None
    if setting is None and args.recompute is None:
        return plan, simulate_plan(plan, profile, cluster, schedule=schedule), None
    check_plan_fits(plan, profile, cluster)
    if schedule is not None and schedule != plan.schedule:
        plan = _replace(plan, schedule=schedule, stages=tuple(_replace(s, warmup=None) for s in plan.stages)).validate()
    modes = args.recompute or [stage.recompute for stage in plan.stages]
    budget = args.memory_gib * 1024**3 if args.memory_gib is not None else None
    if setting is None:
        ooo = bool(plan.ooo)
    else:
        ooo, why = decide_ooo(setting, plan, profile, cluster, recompute=modes)
        plan = with_ooo_choice(plan, ooo, why)
    baseline = None
    if ooo and setting is not None:
        plain = apply_ooo_recompute(plan, profile, cluster, ooo=False, recompute=modes, memory_budget_bytes=budget)
        baseline = simulate_plan(plain, profile, cluster)
    plan = apply_ooo_recompute(plan, profile, cluster, ooo=ooo, recompute=modes, memory_budget_bytes=budget)
    return plan, simulate_plan(plan, profile, cluster), baseline


def _report(args: argparse.Namespace, plan: Plan, result: SimulationResult, baseline: SimulationResult | None) -> None:
    if args.json:
        out = result.to_dict()
        out["recompute"] = [stage.recompute for stage in plan.stages]
        out["ooo"] = plan.ooo
        for key in ("ooo_choice", "schedule_choice"):
            if key in plan.extra:
                out[key] = plan.extra[key]
        if plan.first_k is not None:
            out["first_k"] = plan.first_k
        if baseline is not None:
            out["without_ooo"] = baseline.to_dict(spans=False)
        print(json.dumps(out))
        return
    print_result(result, plan)
    console = make_console()
    if args.schedule == AUTO_SCHEDULE and "Schedule " in plan.reason:  # the sentence choose_schedule added
        console.print(plan.reason[plan.reason.rfind("Schedule ") :])
    if "ooo_choice" in plan.extra and args.ooo == "auto":
        console.print(f"out-of-order backprop: {plan.extra['ooo_choice']}")
    if baseline is not None:
        print_ooo_difference(result, baseline)
    if args.png:
        print(f"wrote {args.png}")


def print_result(result: SimulationResult, plan: Plan) -> None:
    """A rich table per stage, then latency, bubble fraction and the planner formula's estimate."""
    table = Table(title=f"{result.schedule} schedule, M = {result.micro_batches}")
    # K_i: warm-up forwards (5.3); F/B: per micro-batch slice on one device; send: one
    # boundary to the next stage; AR: gradient AllReduce (in brackets the part the backward does not hide); opt: the
    # optimizer step per device (shown where the profile times it); peak: micro-batches in flight.
    split = any(span.kind == "W" for stage in result.stages for span in stage.spans)
    columns = ["stage", "layers", "devices", "K_i", "F ms", "B ms"]
    if split:
        columns += ["W ms"]  # with ooo: B is the input-gradient half, W the weight half
    columns += ["send ms", "AR ms (exposed)"]
    optimizer = any(stage.cost.optimizer_ms for stage in result.stages)
    if optimizer:
        columns += ["opt ms"]
    columns += ["recompute", "peak", "stash MB", "busy %"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("layers", "devices", "recompute") else "right", no_wrap=True)
    for stage_result, stage in zip(result.stages, plan.stages):
        cost = stage_result.cost
        devices = ",".join(str(d) for d in stage_result.devices)
        row = [
            str(stage_result.stage),
            f"[{stage.start}, {stage.end})",
            devices if len(devices) <= 24 else f"{stage_result.devices[0]}..{stage_result.devices[-1]} ({len(stage_result.devices)})",
            str(stage_result.warmup),
            f"{cost.forward_ms:.2f}",
            f"{cost.backward_input_ms if split else cost.backward_ms:.2f}",
        ]
        if split:
            row.append(f"{cost.backward_weight_ms:.2f}")
        row += [
            f"{cost.send_ms:.2f}",
            f"{cost.allreduce_ms:.2f} ({cost.exposed_allreduce_ms:.2f})",
        ]
        if optimizer:
            row.append(f"{cost.optimizer_ms:.2f}")
        row += [
            stage.recompute,
            str(stage_result.peak_in_flight),
            f"{stage_result.peak_stash_bytes / MB:.1f}",
            f"{100 * stage_result.busy_fraction(result.latency_ms):.1f}",
        ]
        table.add_row(*row)
    console = make_console()
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
    if plan.ooo:
        k = "conventional order" if not plan.first_k else f"k = {plan.first_k}"
        console.print(f"out-of-order backprop: W deferred into idle slots; ending phase {k} (ooo-backprop Algorithm 2)")
    if plan.reason and any(stage.recompute != "never" for stage in plan.stages):
        console.print(f"recomputation: {plan.reason}")


def print_ooo_difference(result: SimulationResult, baseline: SimulationResult) -> None:
    """One line each: latency, bubble fraction and peak stash with vs without ooo."""
    console = make_console()
    gain = (baseline.latency_ms - result.latency_ms) / baseline.latency_ms if baseline.latency_ms > 0 else 0.0
    console.print(
        f"with ooo: {result.latency_ms:.3f} ms, bubble {result.bubble_fraction:.4f}; "
        f"without: {baseline.latency_ms:.3f} ms, bubble {baseline.bubble_fraction:.4f} ({100 * gain:+.1f}% faster)"
    )
    with_ooo = ", ".join(f"{s.peak_stash_bytes / MB:.1f}" for s in result.stages)
    without = ", ".join(f"{s.peak_stash_bytes / MB:.1f}" for s in baseline.stages)
    console.print(f"peak stash per stage (MB): with ooo [{with_ooo}], without [{without}]")


if __name__ == "__main__":
    sys.exit(main())
