"""CPU time per thread of one executor on the schedule benchmark's model.

Runs dapple (lightning_dapple's StageRunner) or torch-1F1B on two gloo ranks, width 512,
M=4, and reports each rank's wall time, process CPU time and the CPU time of its busiest
threads (from /proc/self/task, Linux only) over the timed steps, so the main thread and
gloo's ``gloo_tcp_loop`` thread can be compared between the two executors:

    python benchmarks/thread_cpu.py torch-1F1B dapple torch-1F1B dapple
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dapple.execute.launch import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

CONFIG = {"width": 512, "layers": 8, "batch": 64}
MICRO_BATCHES = 4
WARMUP, STEPS = 5, 60


def _thread_cpu_s() -> dict[str, tuple[str, float]]:
    """thread id -> (name, user + system CPU seconds)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _rank_main(rank: int, world: int, variant: str) -> dict[str, Any]:
    import torch.distributed as dist

    import _schedules_worker as worker
    from lightning_dapple.execute.failure import FailureChannel

    if variant == "dapple":
        runner = worker.DappleVariant("dapple", rank, CONFIG, MICRO_BATCHES, FailureChannel(rank, timeout_s=120))
    else:
        runner = worker.TorchPipeVariant("1F1B", rank, CONFIG, MICRO_BATCHES)
    batches = [worker.make_batch(step, CONFIG["batch"], CONFIG["width"]) for step in range(4)]
    for step in range(WARMUP):
        runner.global_loss(runner.step(batches[step % 4]))
    dist.barrier()
    before = _thread_cpu_s()
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(STEPS):
        runner.global_loss(runner.step(batches[step % 4]))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = _thread_cpu_s()
    threads = sorted(
        ((name, seconds - before.get(tid, (name, 0.0))[1]) for tid, (name, seconds) in after.items()), key=lambda item: -item[1]
    )
    if variant == "dapple":
        runner.runner.finish()
    return {"wall_s": wall, "cpu_s": cpu, "threads": [(name, round(s, 3)) for name, s in threads[:4]]}


def main(argv: list[str]) -> int:
    variants = argv or ["torch-1F1B", "dapple"]
    for variant in variants:
        if variant not in ("dapple", "torch-1F1B"):
            print(f"unknown variant {variant!r}: use dapple or torch-1F1B", file=sys.stderr)
            return 2
        ranks = run_ranks(_rank_main, 2, variant, timeout_s=300, raise_on_error=True)
        for rank in sorted(ranks):
            r = ranks[rank]
            print(f"{variant:10s} rank {rank}: wall {r['wall_s']:.3f} s, CPU {r['cpu_s']:.3f} s, threads {r['threads']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
