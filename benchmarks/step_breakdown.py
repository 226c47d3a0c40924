"""Where a training step's wall time goes, dapple vs torch-1F1B, per rank.

Both executors run on the schedule benchmark's model in the same two gloo ranks, alternating
blocks of consecutive steps. Wrapped functions accumulate wall time per step:

* ``compute``: the stage forward and backward (``Stage.forward/backward_input/backward_weight/recompute``;
  ``PipelineStage.forward_one_chunk/backward_one_chunk``);
* ``gloo calls``: the ``isend``/``irecv`` calls themselves (dapple: inside its transport and
  result channel; torch: ``_batch_p2p``), and ``blocked``: waiting on their ``Work``
  (dapple: ``FailureChannel.wait_all``; torch: ``_wait_batch_p2p``);
* ``loss``: getting the global-batch loss to every rank, outside gloo calls and waits (dapple:
  its result hand-off inside the step; torch: a broadcast after it); ``optimizer``: the
  optimizer step;
* ``transport code`` (dapple only): time inside its transport calls that is neither a gloo
  call nor a wait (packing, layouts, bookkeeping);

each part counts exclusive time (a wrapped call inside another is charged to its own part);
* ``rest``: everything else (the schedule loop itself).

    python benchmarks/step_breakdown.py --width 512 --micro-batches 8 [--clock cpu]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

PARTS = ("compute", "gloo calls", "blocked", "transport code", "loss", "optimizer", "rest")


def _rank_main(rank: int, world: int, cfg: dict) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as torch_schedules

    import _schedules_worker as worker
    import lightning_dapple.execute.results as results_module
    import lightning_dapple.execute.transfer.transport as transport_module
    from lightning_dapple.execute.failure import FailureChannel

    torch.set_num_threads(1)
    # wall time, or (--clock cpu) the main thread's CPU time: what is left of a part after
    # leaving out the time the thread was descheduled or asleep in it
    clock = time.thread_time if cfg["clock"] == "cpu" else time.perf_counter
    spent: dict[str, float] = collections.defaultdict(float)
    nested: list[float] = []  # per open wrapped call: time spent in wrapped calls inside it

    def timed(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        """Charge a call's exclusive time (minus wrapped calls inside it) to ``label``."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            nested.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                inner = nested.pop()
                spent[label] += elapsed - inner
                if nested:
                    nested[-1] += elapsed

        return wrapper

    m = cfg["micro_batches"]
    ours = worker.DappleVariant("dapple", rank, cfg, m, FailureChannel(rank, timeout_s=120))
    runner = ours.runner
    stage = runner.pipeline_stage  # its compute methods are looked up on every call
    for name in ("forward", "forward_keeping_input", "recompute", "backward_input", "backward_weight"):
        setattr(stage, name, timed(getattr(stage, name), "compute"))
    runner.failure.wait_all = timed(runner.failure.wait_all, "blocked")
    runner.results.share = timed(runner.results.share, "loss")
    gloo = types.SimpleNamespace(isend=timed(dist.isend, "gloo calls"), irecv=timed(dist.irecv, "gloo calls"))
    gloo.get_backend = dist.get_backend
    transport_module.dist = gloo  # type: ignore[assignment]
    results_module.dist = gloo  # type: ignore[assignment]
    for name in ("send_activation", "recv_activation", "send_gradient", "recv_gradient", "flush"):
        setattr(runner.transport, name, timed(getattr(runner.transport, name), "transport code"))
    ours.optimizer.step = timed(ours.optimizer.step, "optimizer")  # type: ignore[method-assign]

    theirs = worker.TorchPipeVariant("1F1B", rank, cfg, m)
    theirs.stage.forward_one_chunk = timed(theirs.stage.forward_one_chunk, "compute")  # type: ignore[method-assign]
    theirs.stage.backward_one_chunk = timed(theirs.stage.backward_one_chunk, "compute")  # type: ignore[method-assign]
    torch_schedules._wait_batch_p2p = timed(torch_schedules._wait_batch_p2p, "blocked")
    torch_schedules._batch_p2p = timed(torch_schedules._batch_p2p, "gloo calls")
    theirs.optimizer.step = timed(theirs.optimizer.step, "optimizer")  # type: ignore[method-assign]

    variants = [("dapple", ours), ("torch-1F1B", theirs)]
    batches = [worker.make_batch(step, cfg["batch"], cfg["width"]) for step in range(4)]
    for step in range(4):
        for _, variant in variants:
            variant.global_loss(variant.step(batches[step]))
    per: dict[str, dict[str, list[float]]] = {name: collections.defaultdict(list) for name, _ in variants}
    block = cfg["block"]
    for round_ in range(cfg["rounds"]):
        for name, variant in variants if round_ % 2 else variants[::-1]:
            dist.barrier()
            spent.clear()
            start = clock()
            for index in range(block):
                handle = variant.step(batches[index % 4])
                if name == "dapple":
                    variant.global_loss(handle)  # a float already: the hand-off ran inside the step
                else:
                    timed(variant.global_loss, "loss")(handle)
            total = (clock() - start) / block
            part = {key: value / block for key, value in spent.items()}
            part["rest"] = total - sum(part.values())
            per[name]["total"].append(total)
            for key in PARTS:
                per[name][key].append(part.get(key, 0.0))
    runner.finish()
    return {name: {key: statistics.median(values) * 1e3 for key, values in rows.items()} for name, rows in per.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or the main thread's CPU time")
    args = parser.parse_args(argv)
    cfg = {
        "width": args.width, "micro_batches": args.micro_batches, "layers": args.layers, "batch": args.batch,
        "block": args.block, "rounds": args.rounds, "clock": args.clock,
    }
    by_rank = run_ranks(_rank_main, 2, cfg, timeout_s=600, raise_on_error=True)
    from lightning_dapple.plan.console import make_console
    from rich.table import Table

    table = Table(title=f"{'CPU ' if args.clock == 'cpu' else ''}ms per step (median over {args.rounds} blocks of {args.block}), width {args.width}, M={args.micro_batches}")
    for column in ("rank", "executor", "total", *PARTS):
        table.add_column(column, justify="left" if column in ("rank", "executor") else "right")
    for rank in sorted(by_rank):
        for name in ("dapple", "torch-1F1B"):
            row = by_rank[rank][name]
            table.add_row(str(rank), name, f"{row['total']:.2f}", *(f"{row[key]:.2f}" for key in PARTS))
    make_console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
