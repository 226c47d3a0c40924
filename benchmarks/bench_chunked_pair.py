"""One chunked schedule of ours against torch's on the same stages, alone together.

``bench_schedules.py --chunks 2`` rotates seven variants; this script builds only two, ours
(``interleaved`` or ``zbv`` under a chosen K_i policy) and torch's schedule of the same
placement, and alternates blocks of ``--block`` steps of each, ``--rounds`` times, on 2 gloo
ranks of one thread. Reported per rank: the median step time and CPU time of each, and their
ratio. The variants and the model are ``bench_schedules.py``'s (``_schedules_worker``): 16
Linear(1024)+ReLU blocks in 4 stages, M=8, global batch 256. To see where a rank's time goes,
run it under ``py-spy record --idle --subprocesses``: the steps of each run inside
``ours_block`` and ``torch_block``.

    python benchmarks/bench_chunked_pair.py --schedule interleaved --policy PB --rounds 8
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

CFG = {"chunks": 2, "width": 1024, "layers": 16, "batch": 256}
MICRO_BATCHES = 8
TORCH_SCHEDULE = {"interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}
PLACEMENT = {"interleaved": "interleaved", "zbv": "v"}


def _step(variant: Any, batch: Any) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    variant.global_loss(variant.step(batch))
    return time.perf_counter() - wall, time.process_time() - cpu


def ours_block(variant: Any, batches: list[Any]) -> list[tuple[float, float]]:
    return [_step(variant, batch) for batch in batches]


def torch_block(variant: Any, batches: list[Any]) -> list[tuple[float, float]]:
    return [_step(variant, batch) for batch in batches]


def _rank(rank: int, world: int, schedule: str, policy: str, rounds: int, block: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import _schedules_worker as worker
    from lightning_dapple.execute.failure import FailureChannel

    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    placement = worker.stage_ranks(PLACEMENT[schedule], world, CFG["chunks"])
    ours = worker.DappleVariant(schedule, rank, CFG, MICRO_BATCHES, failure, placement=placement, policy=policy)
    theirs = worker.TorchPipeVariant(TORCH_SCHEDULE[schedule], rank, CFG, MICRO_BATCHES, placement=placement)
    batches = [worker.make_batch(step, CFG["batch"], CFG["width"]) for step in range(block)]
    for _ in range(3):  # warm-up
        _step(ours, batches[0])
        _step(theirs, batches[0])
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "torch": []}
    for _ in range(rounds):
        dist.barrier()
        times["ours"] += ours_block(ours, batches)
        dist.barrier()
        times["torch"] += torch_block(theirs, batches)
    ours.runner.finish()
    return {name: (statistics.median(w for w, _ in steps), statistics.median(c for _, c in steps)) for name, steps in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=sorted(TORCH_SCHEDULE), default="interleaved")
    parser.add_argument("--policy", choices=("PA", "PB"), default="PB", help="ours' K_i policy (PB: the order torch's Interleaved1F1B runs)")
    parser.add_argument("--rounds", type=int, default=8, help="blocks of each variant, alternating")
    parser.add_argument("--block", type=int, default=5, help="consecutive steps per block")
    args = parser.parse_args(argv)
    by_rank = run_ranks(_rank, 2, args.schedule, args.policy, args.rounds, args.block, timeout_s=900, raise_on_error=True)
    for rank in sorted(by_rank):
        (ours_s, ours_cpu), (torch_s, torch_cpu) = by_rank[rank]["ours"], by_rank[rank]["torch"]
        print(
            f"rank {rank}: {args.schedule} ({args.policy}) {ours_s * 1e3:.1f} ms, CPU {ours_cpu * 1e3:.1f} ms; "
            f"torch-{TORCH_SCHEDULE[args.schedule]} {torch_s * 1e3:.1f} ms, CPU {torch_cpu * 1e3:.1f} ms; "
            f"ours / torch's {ours_s / torch_s:.3f}, CPU {ours_cpu / torch_cpu:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
