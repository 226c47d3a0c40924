"""Run a function on N local gloo ranks with a hard deadline: the tests' and benchmarks' launcher.

The executor itself is started by Lightning's launchers; this one is for code that wants
many plans and schedules inside one process group without a Trainer (a process start costs
seconds on a small machine, so tests and benchmarks start a group once and loop inside it).
Every rank runs ``fn(rank, world, *args)`` with one intra-op thread (ranks share the
machine's cores) and reports its result or its traceback through a queue; the parent waits
until all have reported, a rank dies, or the deadline passes -- never longer.
"""
from __future__ import annotations

import gc
import os
import queue as queue_module
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ERRORS_KEY = "__errors__"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, results: Any, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        results.put((rank, "ok", result))
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()  # groups fn left in reference cycles: their destructors join gloo's threads (shutdown.py)
    except BaseException as exc:  # reported to the parent, which decides what to do with it
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0, raise_on_error: bool = False
) -> dict[Any, Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; results by rank.

    Ranks that raised (or died before reporting) are collected under ``"__errors__"``
    (rank -> traceback text), or raised as one ``RuntimeError`` with ``raise_on_error``.
    ``fn`` and ``args`` must be picklable (a module-level function). Raises
    ``TimeoutError`` when the ranks have not all reported within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, timeout_s), daemon=True) for r in range(world)]
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) + len(errors) < world:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in done and i not in errors]
                if dead:
                    errors.update({i: f"rank {i} died with exit code {procs[i].exitcode} before reporting" for i in dead})
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s} s; got {sorted(done)} and errors {errors}")
                continue
            (done if status == "ok" else errors)[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
    if errors and raise_on_error:
        first = min(errors)
        raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
    if errors:
        return {ERRORS_KEY: errors, **done}
    return done
