"""``dapple-plan``: plan a model for a cluster and say why (DAPPLE section 4).

    dapple-plan --profile FILE --cluster NAME|FILE --global-batch-size N [--micro-batches M]
                [--planner dapple|pipedream] [--schedule auto|dapple|gpipe|interleaved|zbv] [--policy auto|PA|PB]
                [--profile-batch-size N] [--memory-gib X] [--activation-bytes-per-sample B]
                [--json] [--out plan.json]
    dapple-plan --recipe bert --cluster paper-a
    dapple-plan --model my_pkg.models:make_model --cluster 1x2 --global-batch-size 8

Prints a rich table of stages and the reason (with ``--schedule auto``, the default for the
DAPPLE planner, also which schedule won by simulation, what it beat and by how much; the
PipeDream baseline keeps DAPPLE's schedule unless asked); ``--json`` prints only the plan
JSON (docs/formats.md), the file ``DappleStrategy(plan=...)`` executes. Bad input prints one
line ``error: <field>: <problem>. Fix: <fix>`` and exits 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence


from lightning_dapple.app.recipe_profile import recipe_global_batch, recipe_profile
from lightning_dapple.cluster import load_cluster
from lightning_dapple.errors import DappleConfigError
from lightning_dapple.plan.console import make_console
from lightning_dapple.plan.explain import plan_summary, plan_table
from lightning_dapple.plan.plan import SCHEDULES
from lightning_dapple.plan.schedule_choice import AUTO_SCHEDULE
from lightning_dapple.profile.loader import load_profile
from lightning_dapple.simulate.plans import make_plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dapple-plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="profile JSON or PipeDream graph text file")
    source.add_argument("--recipe", help="plan a recipe's full-size model (bert, gnmt, vgg)")
    source.add_argument(
        "--model",
        help="profile 'pkg.module:factory' on this machine's CPU first (as dapple-profile does; a model without a layer sequence "
        "gets the layer list traced from forward)",
    )
    parser.add_argument("--layers", default="layers", help="with --model: attribute holding the layer sequence, or 'auto' (default: layers)")
    parser.add_argument("--cluster", required=True, help="paper-a, paper-b, paper-c, MxD (e.g. 2x8) or a JSON/YAML file")
    parser.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default for --recipe: the paper's)")
    parser.add_argument("--micro-batches", type=int, help="M; chosen by the planner when left out")
    parser.add_argument("--planner", choices=("dapple", "pipedream"), default="dapple")
    parser.add_argument(
        "--schedule", choices=(AUTO_SCHEDULE, *SCHEDULES),
        help="auto (default with --planner dapple): the fastest simulated schedule that fits for the planned devices and M "
        "(plan/schedule_choice.py); default with --planner pipedream: dapple, so the baseline stays the baseline",
    )
    parser.add_argument(
        "--policy", choices=("auto", "PA", "PB"), default="auto",
        help="K_i warm-up policy (DAPPLE 5.3); auto: the one each plan simulates faster with",
    )
    parser.add_argument(
        "--profile-batch-size", type=int,
        help="batch size of a graph-text profile without pbs-N in its name; with --model, the samples it is profiled on",
    )
    parser.add_argument("--memory-gib", type=float, help="override the cluster's device memory")
    parser.add_argument(
        "--activation-bytes-per-sample", type=float,
        help="measured peak activation memory of one sample through the whole model; the layers' stash is scaled to it "
        "(default for the shared graph profiles: the value their authors planned with; 0: the layer outputs the file lists)",
    )
    parser.add_argument("--device", default="V100", help="device preset for estimated recipe profiles (V100, A100, H100)")
    parser.add_argument("--json", action="store_true", help="print only the plan JSON")
    parser.add_argument("--out", help="also write the plan JSON to this file")
    return parser


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, as for every other bad input
        raise _ArgumentError(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.__class__ = _Parser
    try:
        args = parser.parse_args(argv)
        return _run(args)
    except _ArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DappleConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
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
    kwargs = {"schedule": schedule, "policy": args.policy}
    if args.micro_batches is not None:
        kwargs["micro_batches"] = args.micro_batches
    plan = make_plan(profile, cluster, global_batch, planner=args.planner, **kwargs)
    if args.out:
        plan.save(args.out)
    if args.json:
        print(plan.to_json())
        return 0
    console = make_console()
    console.print(plan_table(plan, profile, cluster))
    console.print(plan_summary(plan))
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
