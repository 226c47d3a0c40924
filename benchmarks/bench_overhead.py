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
* ``--part memory``: resident memory (RSS; allocated memory on a GPU) after step
  ``--warmup`` and after step ``--steps``, with ooo off and on, each alone in a fresh
  process: a variant that keeps something of every step grows.

``--device cuda`` runs on a GPU (``--precision bf16-mixed``/``bf16-true``; ``--model vgg``
for VGG-19): there each variant is built and timed alone, one after the other (full-size
models do not fit side by side), with its peak allocated memory; ``--side-by-side`` times
them in rotating blocks as on the CPU, for models that fit together. ``--trace-dir`` writes
where each variant's host time goes (torch.profiler's operators, cProfile's functions).
``benchmarks/bench_gpu.py`` runs the GPU comparisons with the paper's BERT-48 and VGG-19.

``--part dp`` (two processes): a data-parallel plan of the executor (one stage on both
ranks, M=1, gradients AllReduced in ``plan.buckets`` buckets overlapping the backward)
against ``torch.nn.parallel.DistributedDataParallel`` (what Lightning's ``strategy="ddp"``
wraps the model in), each rank taking half of the global batch.

On the CPU variants run round-robin in blocks of ``--block`` consecutive steps, the start
rotating each round; results are medians of the blocks' time per step and the median of the
per-round ratios (timings on a shared CPU are noisy; ratios of neighbouring blocks are not).

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

    torch.manual_seed(1234)
    if cfg["model"] == "vgg":
        from lightning_dapple.models.vgg import VGG19

        module = VGG19(num_classes=cfg["vocab"], width_multiplier=cfg["width"], image_size=cfg["image"], fc_hidden=cfg["fc"])
    else:
        from lightning_dapple.models.bert import BertMLM

        module = BertMLM(
            vocab_size=cfg["vocab"], hidden=cfg["hidden"], layers=cfg["blocks"], heads=cfg["heads"], ffn=4 * cfg["hidden"],
            seq_len=cfg["seq"], max_positions=max(512, cfg["seq"]), dropout=0.1,
        )
    if cfg["precision"] == "bf16-true":
        module = module.to(torch.bfloat16)
    return module.to(cfg["device"])


def _batches(cfg: dict, count: int = 4) -> list[Any]:
    import torch

    from lightning_dapple.models.common import IGNORE_INDEX

    out = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(count):
        if cfg["model"] == "vgg":
            images = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=generator)
            if cfg["precision"] == "bf16-true":
                images = images.to(torch.bfloat16)
            batch = (images, torch.randint(0, cfg["vocab"], (cfg["batch"],), generator=generator))
        else:
            ids = torch.randint(1, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=generator)
            labels = torch.full_like(ids, IGNORE_INDEX)
            labels[:, ::4] = ids[:, ::4]
            ids[:, ::4] = 1  # the mask token
            batch = (ids, labels)
        out.append(tuple(t.to(cfg["device"]) for t in batch))
    return out


def _autocast(cfg: dict) -> Callable[[], Any]:
    """The forward context of a variant: bf16 autocast under bf16-mixed, else nothing."""
    import contextlib

    import torch

    if cfg["precision"] == "bf16-mixed":
        return lambda: torch.autocast(torch.device(cfg["device"]).type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class _Callbacks:
    """The executor's entry into the model (its forward context already covers the loss)."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Callable[..., Any]) -> Any:
        return self.module.loss(forward(batch[0]), batch[1])


def _plain_step(
    module: Any, optimizer: Any, micro_batches: int, context: Callable[[], Any], rows: slice | None = None
) -> Callable[[Any], None]:
    """What Lightning runs per optimizer step (``accumulate_grad_batches=micro_batches``)."""

    def step(batch: Any) -> None:
        ids, labels = batch if rows is None else (batch[0][rows], batch[1][rows])
        optimizer.zero_grad(set_to_none=True)
        for ids_mb, labels_mb in zip(ids.chunk(micro_batches), labels.chunk(micro_batches)):
            with context():
                loss = module.loss(module(ids_mb), labels_mb) / micro_batches
            loss.backward()
        optimizer.step()

    return step


def _dapple_step(module: Any, rank: int, world: int, cfg: dict, micro_batches: int, ooo: bool, recompute: str) -> tuple[Any, Callable[[Any], None]]:
    import torch

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    layers = len(module.layers)
    plan = plan_from_dict({
        "global_batch_size": cfg["batch"], "micro_batches": micro_batches, "ooo": ooo,
        "stages": [{"layers": [0, layers], "devices": list(range(world)), "recompute": recompute}],
    })
    failure = FailureChannel(rank, timeout_s=300)
    runner = StageRunner.for_plan(
        plan, rank, list(module.layers), torch.device(cfg["device"]), failure,
        forward_context=_autocast(cfg),
        ties=(),
    )
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
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        return None, _plain_step(module, optimizer, 1 if name == "plain" else m, _autocast(cfg))
    if name == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        half = cfg["batch"] // world
        rows = slice(rank * half, (rank + 1) * half)

        class Wrapped:  # DDP's forward, the module's loss
            def __call__(self, x: Any) -> Any:
                return ddp(x)

            loss = staticmethod(module.loss)

        return None, _plain_step(Wrapped(), torch.optim.AdamW(ddp.parameters(), lr=1e-4), 1, _autocast(cfg), rows)
    if name == "dapple-dp":
        return _dapple_step(module, rank, world, cfg, 1, False, "never")
    micro = 1 if name == "dapple-M1" else m
    return _dapple_step(module, rank, world, cfg, micro, name == "dapple-ooo", "always" if name == "dapple-recompute" else "never")


def _sync(cfg: dict) -> None:
    import torch

    if cfg["device"] != "cpu":
        torch.cuda.synchronize()


def _timed_block(step: Callable[[Any], None], batches: list[Any], cfg: dict) -> float:
    """Seconds per step over ``cfg["block"]`` consecutive steps, all ranks lined up."""
    import torch.distributed as dist

    _sync(cfg)
    dist.barrier()
    start = time.perf_counter()
    for index in range(cfg["block"]):
        step(batches[index % len(batches)])
    _sync(cfg)
    dist.barrier()
    return (time.perf_counter() - start) / cfg["block"]


def _round_robin(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """Every variant built at once and timed in rotating blocks, so that drift (clocks,
    other load) falls on all of them alike. On a GPU each variant's peak is what it holds
    (its model, optimizer state and buffers: allocated memory gained while it was built and
    warmed up) plus the most it allocated above that during its blocks."""
    import torch

    cuda = cfg["device"] == "cuda"
    torch.set_num_threads(1)
    batches = _batches(cfg)
    variants, held = [], {}
    for name in cfg["variants"]:
        before = torch.cuda.memory_allocated() if cuda else 0
        runner, step = _variant(name, rank, world, cfg)
        for index in range(cfg["warmup"]):
            step(batches[index % len(batches)])
        variants.append((name, runner, step))
        held[name] = torch.cuda.memory_allocated() - before if cuda else 0
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    above: dict[str, int] = dict.fromkeys(times, 0)
    for round_ in range(cfg["rounds"]):
        shift = round_ % len(variants)
        for name, _, step in variants[shift:] + variants[:shift]:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start = torch.cuda.memory_allocated()
            times[name].append(_timed_block(step, batches, cfg))
            if cuda:
                above[name] = max(above[name], torch.cuda.max_memory_allocated() - start)
    if cfg.get("trace_dir"):
        for name, _, step in variants:
            _trace(name, step, batches, cfg)
    for _, runner, _ in variants:
        if runner is not None:
            runner.finish()
    if not cuda:
        return {"times": times}
    return {"times": times, "peak_gib": {name: (held[name] + above[name]) / 2**30 for name in times}}


def _trace(name: str, step: Callable[[Any], None], batches: list[Any], cfg: dict) -> None:
    """Where one variant's host time goes over a block of steps, written under
    ``cfg["trace_dir"]``: ``<model>_<variant>_ops.txt`` (torch.profiler's operators, by self
    CPU time, with the device's time beside them) and ``<model>_<variant>_python.txt``
    (cProfile's Python functions, by own time)."""
    import cProfile
    import io
    import pstats

    import torch

    folder = Path(cfg["trace_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"{cfg['model']}_{name}"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cfg["device"] == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        for index in range(cfg["block"]):
            step(batches[index % len(batches)])
        _sync(cfg)
    stem.with_name(stem.name + "_ops.txt").write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    python = cProfile.Profile()
    python.enable()
    for index in range(cfg["block"]):
        step(batches[index % len(batches)])
    _sync(cfg)
    python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(40)
    stem.with_name(stem.name + "_python.txt").write_text(text.getvalue())


def _one_at_a_time(rank: int, world: int, cfg: dict) -> dict[str, Any]:
    """Each variant alone on the GPU (a full-size model per variant would not fit beside the
    others): its blocks' times and its peak allocated memory."""
    import gc

    import torch

    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    batches = _batches(cfg)
    for name in cfg["variants"]:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        runner, step = _variant(name, rank, world, cfg)
        for index in range(cfg["warmup"]):
            step(batches[index % len(batches)])
        times[name] = [_timed_block(step, batches, cfg) for _ in range(cfg["rounds"])]
        peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        if cfg.get("trace_dir"):
            _trace(name, step, batches, cfg)
        if runner is not None:
            runner.finish()
        del runner, step
    return {"times": times, "peak_gib": peaks}


def _rss_mib() -> float:
    import os

    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory(rank: int, world: int, cfg: dict) -> dict[str, float]:
    """Resident memory (CPU) or allocated GPU memory (MiB) after warm-up and after the last step."""
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
            used = torch.cuda.memory_allocated() / 2**20 if cfg["device"] == "cuda" else _rss_mib()
            out[f"mib_after_step_{index + 1}"] = used
    if runner is not None:
        runner.finish()
    return out


def _report(measured: dict[str, Any], pairs: Any) -> dict[str, Any]:
    times = measured["times"]
    result: dict[str, Any] = {"median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()}, "ratios": {}}
    if "peak_gib" in measured:
        result["peak_gib"] = measured["peak_gib"]
    for name, base in pairs:
        if name in times and base in times:
            ratio = statistics.median(a / b for a, b in zip(times[name], times[base]))
            result["ratios"][f"{name} / {base}"] = ratio
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("single", "dp", "memory"), default="single")
    parser.add_argument("--model", choices=("bert", "vgg"), default="bert")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "bf16-true"), default="32-true")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512, help="BERT vocabulary / VGG classes")
    parser.add_argument("--width", type=float, default=1 / 16, help="VGG width multiplier")
    parser.add_argument("--image", type=int, default=32, help="VGG image size")
    parser.add_argument("--fc", type=int, default=256, help="VGG hidden FC width")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--block", type=int, default=3, help="consecutive steps per timed block")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="--part memory: steps per variant")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--side-by-side", action="store_true", help="--device cuda: build every variant at once and time them in rotating blocks, as on the CPU (for models small enough to fit together)")
    parser.add_argument("--variants", nargs="+", choices=SINGLE, default=list(SINGLE), help="--part single: the variants to run")
    parser.add_argument("--trace-dir", type=Path, default=None, help="--device cuda: each variant's operators and Python functions profiled over a block of steps, written here")
    args = parser.parse_args(argv)
    keys = ("model", "device", "precision", "hidden", "blocks", "heads", "seq", "vocab", "width", "image", "fc", "batch", "block", "rounds", "warmup", "steps")
    cfg = {k: getattr(args, k) for k in keys}
    cfg["micro_batches"] = args.micro_batches
    if args.part == "single":
        cfg["variants"] = list(args.variants)
        cfg["trace_dir"] = str(args.trace_dir) if args.trace_dir else None
        measure = _one_at_a_time if args.device == "cuda" and not args.side_by_side else _round_robin
        result = _report(run_ranks(measure, 1, cfg, timeout_s=3600, raise_on_error=True)[0], PAIRS)
    elif args.part == "dp":
        cfg["variants"] = ["ddp", "dapple-dp"]
        result = _report(run_ranks(_round_robin, 2, cfg, timeout_s=1800, raise_on_error=True)[0], [("dapple-dp", "ddp")])
    else:
        result = {"memory_mib": {}}
        for name in ("dapple", "dapple-ooo"):
            cfg["variants"] = [name]
            result["memory_mib"][name] = run_ranks(_memory, 1, cfg, timeout_s=1800, raise_on_error=True)[0]
    result["config"] = {**cfg, "part": args.part}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
