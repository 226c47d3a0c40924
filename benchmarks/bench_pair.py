"""Quick paired comparison of a few executors on the schedule benchmark's model.

``bench_schedules.py`` runs all six variants; this one runs only the ones named, so that a
change can be checked against ``torch-1F1B`` in a few seconds, and so that the effect of the
other variants sharing the machine can be seen (see benchmarks/README.md). Variants run
round-robin in blocks of ``--block`` consecutive training steps (each step ending with the
global-batch loss on every rank, as in ``bench_schedules.py``); the result is the median time
per step and the median per-round ratio to the first variant named.

    python benchmarks/bench_pair.py torch-1F1B dapple --width 512 --micro-batches 8
    python benchmarks/bench_pair.py torch-1F1B dapple dapple-nosettle --width 512 --micro-batches 8 --rounds 40
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

NAMES = ("torch-1F1B", "torch-GPipe", "dapple", "dapple-ooo", "dapple-ahead", "dapple-nosettle", "gpipe", "ddp")


def _rank_main(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    import torch

    import _schedules_worker as worker
    from lightning_dapple.execute.failure import FailureChannel

    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    m = cfg["micro_batches"]

    def make(name: str) -> Any:
        if name.startswith("torch-"):
            return worker.TorchPipeVariant(name.removeprefix("torch-"), rank, cfg, m)
        if name == "ddp":
            return worker.DDPVariant(rank, world, cfg)
        schedule, _, option = name.partition("-")
        return worker.DappleVariant(
            schedule,
            rank,
            cfg,
            m,
            failure,
            post_ahead=True if option == "ahead" else None,
            settle_sends=option != "nosettle",
            ooo=option == "ooo",
        )

    variants = [(name, make(name)) for name in cfg["variants"]]
    batches = [worker.make_batch(step, cfg["batch"], cfg["width"]) for step in range(4)]
    for step in range(cfg["warmup"]):
        for _, variant in variants:
            variant.global_loss(variant.step(batches[step % len(batches)]))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for round_ in range(cfg["rounds"]):
        shift = round_ % len(variants)
        for name, variant in variants[shift:] + variants[:shift]:
            seconds, _, _ = worker._timed(variant, batches, round_, cfg["block"])
            times[name].append(seconds)
    for _, variant in variants:
        if isinstance(variant, worker.DappleVariant):
            variant.runner.finish()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", choices=NAMES, help="variants; ratios are to the first")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block", type=int, default=8, help="consecutive steps per timed block")
    parser.add_argument("--rounds", type=int, default=15, help="timed blocks per variant")
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)
    if len(set(args.variants)) != len(args.variants):
        parser.error("name each variant once")
    if args.batch % args.micro_batches or args.layers % 2:
        parser.error("--micro-batches must divide --batch, and --layers must be even")
    cfg = {
        "variants": args.variants, "width": args.width, "micro_batches": args.micro_batches, "layers": args.layers,
        "batch": args.batch, "block": args.block, "rounds": args.rounds, "warmup": args.warmup,
    }
    times = run_ranks(_rank_main, 2, cfg, timeout_s=600, raise_on_error=True)[0]
    reference = times[args.variants[0]]
    print(f"width {args.width}, M={args.micro_batches}, {args.rounds} blocks of {args.block} steps")
    for name in args.variants:
        paired = statistics.median(a / b for a, b in zip(times[name], reference))
        print(f"{name:13s} median {statistics.median(times[name]) * 1e3:7.2f} ms/step   paired / {args.variants[0]}: {paired:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
