"""The executor's cost against what a user would otherwise run, side by side on the CPU.

Model: a small BERT (``lightning_dapple.models.bert`` layers: embeddings, ``--blocks``
post-LN blocks of width ``--hidden``, the MLM head; dropout 0.1), masked-LM loss, AdamW,
float32, one intra-op thread per rank. Every variant trains the same global batches.

``--part single`` (one process, one pipeline stage): what the pipeline machinery costs when
there is no pipeline to gain from.

* ``plain``: forward/backward of the whole global batch and an optimizer step, as plain
  Lightning runs it; ``accumulate``: M micro-batches with the loss divided by M and one
  step, as Lightning's ``accumulate_grad_batches=M`` runs it;
* ``dapple-M1``: the executor with one micro-batch (compared with ``plain``);
  ``dapple``, ``dapple-ooo`` (out-of-order backprop: weight gradients deferred to W),
  ``dapple-recompute`` (recompute="always"): the executor with M micro-batches (compared
  with ``accumulate``; ooo and recompute also with ``dapple``);
* resident memory (RSS) after step ``--warmup`` and after the last step, per variant run
  alone in a fresh process: a variant that keeps something of every step grows.

``--part dp`` (two processes): a data-parallel plan of the executor (one stage on both
ranks, M=1, gradients AllReduced in ``plan.buckets`` buckets overlapping the backward)
against ``torch.nn.parallel.DistributedDataParallel`` (what Lightning's ``strategy="ddp"``
wraps the model in), each rank taking half of the global batch.

Variants run round-robin in blocks of ``--block`` consecutive steps, the start rotating each
round; results are medians of the blocks' time per step and the median of the per-round
ratios (timings on this machine are noisy; ratios of neighbouring blocks are not).

    python benchmarks/bench_overhead.py --part single      # ratios of the executor to plain/accumulate
    python benchmarks/bench_overhead.py --part dp          # dapple DP plan vs torch DDP, 2 ranks
    python benchmarks/bench_overhead.py --part memory      # RSS growth with ooo on and off
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
SINGLE = ("plain", "accumulate", "dapple-M1", "dapple", "dapple-ooo", "dapple-recompute")
PAIRS = (
    ("dapple-M1", "plain"), ("dapple", "accumulate"), ("dapple-ooo", "accumulate"),
    ("dapple-ooo", "dapple"), ("dapple-recompute", "dapple"),
)


def _model(cfg: dict) -> Any:
    import torch

    from lightning_dapple.models.bert import BertMLM

    torch.manual_seed(1234)
    return BertMLM(
        vocab_size=cfg["vocab"], hidden=cfg["hidden"], layers=cfg["blocks"], heads=cfg["heads"], ffn=4 * cfg["hidden"],
        seq_len=cfg["seq"], dropout=0.1,
    )


def _batches(cfg: dict, count: int = 4) -> list[Any]:
    import torch

    from lightning_dapple.models.common import IGNORE_INDEX

    out = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(count):
        ids = torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=generator)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, ::4] = ids[:, ::4]
        ids[:, ::4] = 1  # the mask token
        out.append((ids, labels))
    return out


class _Callbacks:
    def __init__(self, module: Any) -> None:
        self.module = module

    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> Any:
        return self.module.loss(forward(batch[0]), batch[1])


def _plain_step(module: Any, optimizer: Any, micro_batches: int, rows: slice | None = None) -> Callable[[Any], None]:
    """What Lightning runs per optimizer step (``accumulate_grad_batches=micro_batches``)."""

    def step(batch: Any) -> None:
        ids, labels = batch if rows is None else (batch[0][rows], batch[1][rows])
        optimizer.zero_grad(set_to_none=True)
        for ids_mb, labels_mb in zip(ids.chunk(micro_batches), labels.chunk(micro_batches)):
            loss = module.loss(module(ids_mb), labels_mb) / micro_batches
            loss.backward()
        optimizer.step()

    return step


def _dapple_step(module: Any, rank: int, world: int, cfg: dict, micro_batches: int, ooo: bool, recompute: str) -> tuple[Any, Callable[[Any], None]]:
    import torch

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.schedule import schedule_for_plan

    layers = len(module.layers)
    plan = plan_from_dict({
        "global_batch_size": cfg["batch"], "micro_batches": micro_batches, "ooo": ooo,
        "stages": [{"layers": [0, layers], "devices": list(range(world)), "recompute": recompute}],
    })
    failure = FailureChannel(rank, timeout_s=300)
    runner = StageRunner(plan, schedule_for_plan(plan), rank, list(module.layers), torch.device("cpu"), failure, build_groups(plan))
    optimizer = torch.optim.AdamW(runner.parameters, lr=1e-4)
    callbacks = _Callbacks(module)

    def step(batch: Any) -> None:
        runner.train_step(batch, callbacks)
        optimizer.step()

    return runner, step


def _variant(name: str, rank: int, world: int, cfg: dict) -> tuple[Any, Callable[[Any], None]]:
    import torch

    module = _model(cfg)
    m = cfg["micro_batches"]
    if name in ("plain", "accumulate"):
        return None, _plain_step(module, torch.optim.AdamW(module.parameters(), lr=1e-4), 1 if name == "plain" else m)
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        half = cfg["batch"] // world
        rows = slice(rank * half, (rank + 1) * half)

        class Wrapped:  # DDP's forward, the module's loss
            def __call__(self, x: Any) -> Any:
                return ddp(x)

            loss = staticmethod(module.loss)

        return None, _plain_step(Wrapped(), torch.optim.AdamW(ddp.parameters(), lr=1e-4), 1, rows)
    if name == "dapple-dp":
        return _dapple_step(module, rank, world, cfg, 1, False, "never")
    micro = 1 if name == "dapple-M1" else m
    return _dapple_step(module, rank, world, cfg, micro, name == "dapple-ooo", "always" if name == "dapple-recompute" else "never")


def _round_robin(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    variants = [(name, *_variant(name, rank, world, cfg)) for name in cfg["variants"]]
    batches = _batches(cfg)
    for _, _, step in variants:
        for index in range(cfg["warmup"]):
            step(batches[index % len(batches)])
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for round_ in range(cfg["rounds"]):
        shift = round_ % len(variants)
        for name, _, step in variants[shift:] + variants[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for index in range(cfg["block"]):
                step(batches[index % len(batches)])
            dist.barrier()
            times[name].append((time.perf_counter() - start) / cfg["block"])
    for _, runner, _ in variants:
        if runner is not None:
            runner.finish()
    return times


def _rss_mib() -> float:
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory(rank: int, world: int, cfg: dict) -> dict[str, float]:
    import gc

    import torch

    torch.set_num_threads(1)
    name = cfg["variants"][0]
    runner, step = _variant(name, rank, world, cfg)
    batches = _batches(cfg)
    out = {}
    for index in range(cfg["steps"]):
        step(batches[index % len(batches)])
        if index + 1 in (cfg["warmup"], cfg["steps"]):
            gc.collect()
            out[f"rss_after_step_{index + 1}"] = _rss_mib()
    if runner is not None:
        runner.finish()
    return out


def _report(times: dict[str, list[float]], pairs: Any) -> dict[str, Any]:
    result: dict[str, Any] = {"median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()}, "ratios": {}}
    for name, base in pairs:
        if name in times and base in times:
            ratio = statistics.median(a / b for a, b in zip(times[name], times[base]))
            result["ratios"][f"{name} / {base}"] = ratio
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("single", "dp", "memory"), default="single")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--block", type=int, default=3, help="consecutive steps per timed block")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="--part memory: steps per variant")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("hidden", "blocks", "heads", "seq", "vocab", "batch", "block", "rounds", "warmup", "steps")}
    cfg["micro_batches"] = args.micro_batches
    if args.part == "single":
        cfg["variants"] = list(SINGLE)
        result = _report(run_ranks(_round_robin, 1, cfg, timeout_s=1800, raise_on_error=True)[0], PAIRS)
    elif args.part == "dp":
        cfg["variants"] = ["ddp", "dapple-dp"]
        result = _report(run_ranks(_round_robin, 2, cfg, timeout_s=1800, raise_on_error=True)[0], [("dapple-dp", "ddp")])
    else:
        result = {"rss_mib": {}}
        for name in ("dapple", "dapple-ooo"):
            cfg["variants"] = [name]
            result["rss_mib"][name] = run_ranks(_memory, 1, cfg, timeout_s=1800, raise_on_error=True)[0]
    result["config"] = {**cfg, "part": args.part}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
