"""Run a function on N spawned gloo ranks with a hard timeout, returning each rank's result."""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0) -> dict[int, Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; results by rank, or the errors raised."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, timeout_s), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_module

    import time

    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results and i not in errors]
                if dead:
                    errors.update({i: f"rank {i} died with exit code {procs[i].exitcode} before reporting" for i in dead})
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s; got {sorted(results)} and errors {errors}")
                continue
            (results if status == "ok" else errors)[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    if errors:
        return {"__errors__": errors, **results}
    return results
