"""What a stage's backward costs in a pipeline step against what the layer profile says.

The profiler (PipeDream 3.2) times each layer's backward alone, with ``torch.autograd.grad``,
so no gradient is accumulated. In a step of M micro-batches every backward after the first
adds its weight gradients into ``.grad`` (autograd's AccumulateGrad: the first steals the new
tensor, the others add in place), one pass over the stage's parameters per micro-batch, which
a step of one micro-batch (data parallelism at M = 1) never pays. This script measures, on one
stage of the schedule benchmark's MLP (``_schedules_worker.make_blocks``) in one process with
one thread, in rounds that alternate the variants:

* ``profile``: the sum of the stage's layers' profiled backward (``profile_layers``);
* ``fresh``: the whole stage's ``backward()`` with every ``.grad`` cleared first (a step's first
  micro-batch);
* ``accumulating``: the same backward onto existing gradients (every later micro-batch);
* ``add``: adding one gradient of every parameter of the stage into another (``add_``);
* ``priced``: what the profile prices for that add, the sum of the layers'
  ``LayerProfile.accumulate_ms`` (``profile/grad_accumulation.py``: each layer timed alone).

    python benchmarks/bench_grad_accumulation.py --width 1024 --layers 8 --rows 32 --rounds 9
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _schedules_worker import make_blocks  # noqa: E402
from lightning_dapple.profile.profiler import profile_layers  # noqa: E402

VARIANTS = ("profile", "fresh", "accumulating", "add")
REPORTED = (*VARIANTS, "priced")


def _median_ms(call: Callable[[], float], times: int) -> float:
    return statistics.median(call() for _ in range(times))


def measure(width: int, layers: int, rows: int, rounds: int, times: int) -> dict[str, list[float]]:
    """Per variant, its median milliseconds in each round (module docstring)."""
    torch.manual_seed(0)
    stage = nn.Sequential(*make_blocks(width, layers))
    params = [param for param in stage.parameters() if param.requires_grad]
    x = torch.randn(rows, width)
    sums = [torch.zeros_like(param) for param in params]
    news = [torch.randn_like(param) for param in params]

    def backward(fresh: bool) -> float:
        if fresh:
            for param in params:
                param.grad = None
        out = stage(x.clone().requires_grad_())
        start = time.perf_counter()
        out.sum().backward()
        return (time.perf_counter() - start) * 1000.0

    def add() -> float:
        start = time.perf_counter()
        for total, new in zip(sums, news):
            total.add_(new)
        return (time.perf_counter() - start) * 1000.0

    priced: list[float] = []

    def profiled() -> float:
        profile = profile_layers(stage, x, repeats=5, warmup=2)
        priced.append(sum(layer.accumulate_ms for layer in profile.layers))
        return sum(layer.backward_ms for layer in profile.layers)

    calls = {"profile": profiled, "fresh": lambda: backward(True), "accumulating": lambda: backward(False), "add": add}
    for call in calls.values():  # warm-up
        call()
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_index in range(rounds):
        order = VARIANTS[round_index % len(VARIANTS):] + VARIANTS[: round_index % len(VARIANTS)]
        for name in order:
            results[name].append(calls[name]() if name == "profile" else _median_ms(calls[name], times))
    results["priced"] = priced[1:]  # the warm-up's is left out
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks in the stage")
    parser.add_argument("--rows", type=int, default=32, help="rows of a micro-batch")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--times", type=int, default=9, help="timed calls per variant per round (median)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = measure(args.width, args.layers, args.rows, args.rounds, args.times)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"stage of {args.layers} blocks of width {args.width}, {args.rows} rows, one thread; median of {args.rounds} rounds (ms):")
    print(
        "| profiled backward (sum of layers) | stage backward, gradients cleared | stage backward, accumulating "
        "| accumulating - cleared | adding the stage's gradients once | priced by the profile (sum of layers' accumulate_ms) |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {medians['profile']:.2f} | {medians['fresh']:.2f} | {medians['accumulating']:.2f} | "
        f"{medians['accumulating'] - medians['fresh']:.2f} | {medians['add']:.2f} | {medians['priced']:.2f} |"
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "rounds": results, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
