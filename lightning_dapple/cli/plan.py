"""dapple-plan: plan a model for a cluster and say why (DAPPLE section 4).

The model comes from a profile file (--profile), a recipe's full-size model (--recipe) or
a model factory profiled on this machine's CPU first (--model). The planner chooses the
stages, their devices and the number of micro-batches M; with --schedule auto (the default
for the DAPPLE planner) it also runs the planned devices and M under the fastest simulated
schedule that fits, and says which won, what it beat and by how much. The PipeDream
baseline keeps DAPPLE's schedule unless asked. --ooo decides out-of-order backprop the way
DappleStrategy(ooo=...) does and records the choice in the plan.

Prints a table of stages and the reason; --json prints only the plan JSON
(docs/formats.md), the file DappleStrategy(plan=...) runs. Bad input prints one line
"error: <field>: <problem>. Fix: <fix>" and exits with status 2.

Examples:
  dapple-plan --recipe bert --cluster paper-a
  dapple-plan --recipe gnmt --cluster paper-b --schedule gpipe --micro-batches 16
  dapple-plan --profile bert-48-pbs-2.txt --cluster 2x8 --global-batch-size 64 --json --out plan.json
  dapple-plan --model my_pkg.models:make_model --cluster 1x2 --global-batch-size 8
  dapple-plan --recipe vgg --cluster paper-a --planner pipedream
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from lightning_dapple.app.recipe_profile import recipe_global_batch, recipe_profile
from lightning_dapple.cli.common import CLUSTER_HELP, ArgumentError, add_ooo, ooo_finisher, ooo_setting, parser_from_doc
from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.explain import plan_summary, plan_table
from lightning_dapple.plan.plan import SCHEDULES
from lightning_dapple.plan.schedule_choice import AUTO_SCHEDULE
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate.plan_and_schedule import make_plan

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = parser_from_doc("dapple-plan", __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", metavar="FILE", help="a profile JSON (dapple-profile --out) or a PipeDream graph text file")
    source.add_argument("--recipe", metavar="NAME", help="a recipe's full-size model, its profile estimated for --device: bert, gnmt or vgg")
    source.add_argument(
        "--model", metavar="PKG.MODULE:FACTORY",
        help="profile this model on this machine's CPU first, as dapple-profile does (a model without a layer sequence gets the layer list "
        "traced from forward)",
    )
    parser.add_argument("--layers", default="layers", help="with --model: attribute holding the layer sequence, or 'auto' (default: layers)")
    parser.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    parser.add_argument("--global-batch-size", type=int, metavar="N", help="samples per optimizer step (default with --recipe: the paper's)")
    parser.add_argument("--micro-batches", type=int, metavar="M", help="number of micro-batches per step; chosen by the planner when left out")
    parser.add_argument("--planner", choices=("dapple", "pipedream"), default="dapple", help="DAPPLE's planner, or PipeDream's partitioner as the baseline (default: dapple)")
    parser.add_argument(
        "--schedule", choices=(AUTO_SCHEDULE, *SCHEDULES),
        help="auto: the fastest simulated schedule that fits the planned devices and M (plan/schedule_choice.py); default: auto with "
        "--planner dapple, dapple with --planner pipedream (the baseline stays the baseline)",
    )
    parser.add_argument(
        "--policy", choices=("auto", "PA", "PB"), default="auto",
        help="K_i warm-up policy (DAPPLE 5.3); auto: the one each plan simulates faster with (default: auto)",
    )
    add_ooo(parser, "default: auto with --planner dapple, false with --planner pipedream")
    parser.add_argument(
        "--zero", choices=("0", "1", "2", "auto"), default="0",
        help="ZeRO over a replicated stage's replicas, as DappleStrategy(zero=...) takes it: 1 shards the optimizer state, "
        "2 also the gradients, auto lets the planner choose per stage (default: 0)",
    )
    parser.add_argument(
        "--profile-batch-size", type=int, metavar="N",
        help="batch size of a graph-text profile without pbs-N in its name; with --model, the samples it is profiled on",
    )
    parser.add_argument("--memory-gib", type=float, metavar="GIB", help="device memory in GiB, instead of the cluster's")
    parser.add_argument(
        "--activation-bytes-per-sample", type=float, metavar="BYTES",
        help="measured peak activation memory of one sample through the whole model; the layers' stash is scaled to it "
        "(default for the shared graph profiles: the value their authors planned with; 0: the layer outputs the file lists)",
    )
    parser.add_argument("--device", default="V100", help="with --recipe: the device the profile is estimated for: V100, A100 or H100 (default: V100)")
    parser.add_argument("--json", action="store_true", help="print only the plan JSON")
    parser.add_argument("--out", metavar="FILE", help="also write the plan JSON to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return _run(args)
    except (ArgumentError, DappleConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.recipe:
        profile = recipe_profile(args.recipe, device=args.device)
        global_batch = args.global_batch_size or recipe_global_batch(args.recipe)
    elif args.model:
        profile = _profile_of_model(args)
        global_batch = args.global_batch_size
    else:
        profile = load_profile(args.profile, args.profile_batch_size, args.activation_bytes_per_sample)
        global_batch = args.global_batch_size
    if global_batch is None:
        raise DappleConfigError("--global-batch-size", "is missing", "pass the number of samples of one optimizer step")
    if global_batch <= 0:
        raise DappleConfigError("--global-batch-size", f"is {global_batch}", "pass a positive number of samples")
    cluster = load_cluster(args.cluster, device_memory_gib=args.memory_gib)
    schedule = args.schedule or (AUTO_SCHEDULE if args.planner == "dapple" else "dapple")
    ooo = ooo_setting(args.ooo or ("auto" if args.planner == "dapple" else "false"))
    kwargs: dict[str, Any] = {"schedule": schedule, "policy": args.policy}
    if args.zero != "0":
        if args.planner != "dapple":
            raise DappleConfigError("--zero", f"is {args.zero} with --planner {args.planner}", "use --zero with DAPPLE's planner (--planner dapple)")
        kwargs["zero"] = args.zero if args.zero == "auto" else int(args.zero)
    if args.micro_batches is not None:
        kwargs["micro_batches"] = args.micro_batches
    plan = make_plan(profile, cluster, global_batch, planner=args.planner, finish=ooo_finisher(ooo, profile, cluster), **kwargs)
    if args.out:
        plan.save(args.out)
    if args.json:
        print(plan.to_json())
        return 0
    console = make_console()
    console.print(plan_table(plan, profile, cluster))
    console.print(plan_summary(plan))
    if "ooo_choice" in plan.extra:
        console.print(f"out-of-order backprop: {plan.extra['ooo_choice']}")
    memory = profile.meta.get("activation_memory")
    if memory:
        console.print(f"activation memory: {memory['bytes_per_sample'] / 1e9:.2f} GB per sample ({memory['source']})")
    if args.out:
        console.print(f"plan written to {args.out}")
    return 0


def _profile_of_model(args: argparse.Namespace) -> Any:
    """``dapple-profile``'s measurement of ``--model`` with its defaults (CPU, 5 timed runs)."""
    from lightning_dapple.cli.profile_run import profile_model  # torch: only when a model is to be timed

    settings = argparse.Namespace(
        model=args.model, layers=args.layers, batch_size=args.profile_batch_size, device="cpu", repeats=5, warmup=2, cache_dir=None, name=None
    )
    return profile_model(settings, say=lambda text: print(text, file=sys.stderr))  # stdout may be the plan JSON


if __name__ == "__main__":
    sys.exit(main())
