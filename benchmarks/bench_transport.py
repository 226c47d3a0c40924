"""Per-transfer cost of the transport's wire policies, paired, on two local gloo ranks.

Rank 0 sends an activation (``--rows`` x ``--width`` float32, requiring grad) to rank 1,
which sends its gradient back; a round is ``--transfers`` such round trips and a flush.
Variants run round-robin in one process group, so each round's ratio to the first variant
compares them under the same machine load. The ``gloo`` wire is what a CPU run uses; the
forced ``staged`` and ``nccl`` wires show what the staging code and the per-link, flagged
messages cost on CPU (their GPU costs are in the CUDA copies and NCCL, not measured here).
``--baseline FILE`` adds another transport module's ``Transport`` (e.g. an earlier
``execute/transfer/transport.py``) as the first variant, to check that the steady-state fast path
did not get slower:

    python benchmarks/bench_transport.py --width 512 --rows 8 --rounds 40
    git show REV:lightning_dapple/execute/transfer/transport.py > /tmp/transport_rev.py
    python benchmarks/bench_transport.py --baseline /tmp/transport_rev.py gloo --rounds 60

On a loaded machine gloo's thread hand-offs dominate a round trip and swing by tens of
percent; ``--python-only`` measures what the transport itself adds: one process, with
``isend``/``irecv`` replaced by works that are complete at once (receive buffers keep
whatever they were made with), so a round trip is only the transport's own Python and
tensor operations:

    python benchmarks/bench_transport.py --baseline /tmp/transport_rev.py gloo --python-only

``--clock cpu`` times the main thread's CPU time instead of wall time (what the transport
costs the rank's compute thread, with the waits for the peer left out).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from typing import Any

from lightning_dapple.execute.launch import run_ranks

WIRES = ("gloo", "staged", "nccl")


def _factory(name: str, baseline: str | None) -> Any:
    import torch

    from lightning_dapple.execute.transfer.transport import Transport

    if name == "baseline":
        spec = importlib.util.spec_from_file_location("baseline_transport", baseline)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        return lambda failure: module.Transport(failure, torch.device("cpu"))
    return lambda failure: Transport(failure, torch.device("cpu"), wire=name)


def _round(rank: int, transport: Any, cfg: dict, peers: Any, acts: list, grads: list) -> float:
    clock = time.thread_time if cfg.get("clock") == "cpu" else time.perf_counter
    start = clock()
    for index in range(cfg["transfers"]):
        what = f"activation {index}"
        if rank == 0:
            transport.send_activation(acts[index], (0, cfg["rows"]), peers, what)
            transport.recv_gradient([acts[index]], (0, cfg["rows"]), peers, f"gradient {index}")
        else:
            transport.recv_activation((0, cfg["rows"]), peers, what)
            transport.send_gradient([grads[index]], (0, cfg["rows"]), peers, f"gradient {index}")
    transport.flush()
    return clock() - start


def _rank_main(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    import torch

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Peer

    torch.set_num_threads(1)
    failure = FailureChannel(rank, timeout_s=120)
    peers = [Peer(1 - rank, (0, cfg["rows"]))]
    acts = [torch.randn(cfg["rows"], cfg["width"], requires_grad=True) for _ in range(cfg["transfers"])]
    grads = [torch.randn(cfg["rows"], cfg["width"]) for _ in range(cfg["transfers"])]
    variants = [(name, _factory(name, cfg["baseline"])(failure)) for name in cfg["variants"]]
    for _ in range(cfg["warmup"]):
        for _, transport in variants:
            _round(rank, transport, cfg, peers, acts, grads)
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for index in range(cfg["rounds"]):
        shift = index % len(variants)
        for name, transport in variants[shift:] + variants[:shift]:
            times[name].append(_round(rank, transport, cfg, peers, acts, grads) / cfg["transfers"])
    return times


class _Done:
    """A completed Work."""

    def wait(self, *args: Any) -> bool:
        return True


def _python_only(cfg: dict) -> dict[str, list[float]]:
    """The round trips of ``_round`` in one process, with no communication (see above)."""
    import torch
    import torch.distributed as dist
    from torch.utils import _pytree as pytree

    from lightning_dapple.execute.transfer.transport import LeafMeta, Peer

    torch.set_num_threads(1)
    dist.isend = dist.irecv = lambda *args, **kwargs: _Done()  # this process only runs the benchmark

    class Failure:
        def wait(self, work: Any, what: str) -> None:
            work.wait()

        def wait_all(self, works: Any, what: str) -> None:
            for work in works:
                work.wait()

    peers = [Peer(1, (0, cfg["rows"]))]
    acts = [torch.randn(cfg["rows"], cfg["width"], requires_grad=True) for _ in range(cfg["transfers"])]
    grads = [torch.randn(cfg["rows"], cfg["width"]) for _ in range(cfg["transfers"])]
    layout = ((LeafMeta(torch.float32, True, (cfg["width"],)),), pytree.tree_flatten(acts[0])[1])
    variants = []
    for name in cfg["variants"]:
        if name == "nccl":
            continue  # its constructor creates process groups
        transport = _factory(name, cfg["baseline"])(Failure())
        # the steady state: layouts known per (peer, tag) (untagged: tag 0), or per peer in a
        # baseline transport from before tagged streams
        known = (1, 0) if hasattr(transport, "tagged") else 1
        transport._layout_sent[known] = transport._layout_received[known] = layout
        variants.append((name, transport))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for index in range(cfg["rounds"] + cfg["warmup"]):
        shift = index % len(variants)
        for name, transport in variants[shift:] + variants[:shift]:
            start = time.perf_counter()
            for rank in (0, 1):
                _round(rank, transport, cfg, peers, acts, grads)
            if index >= cfg["warmup"]:
                times[name].append((time.perf_counter() - start) / cfg["transfers"])
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", help=f"wires to force, of {', '.join(WIRES)} (default: all); ratios are to the first")
    parser.add_argument("--baseline", help="a transport.py whose Transport runs first, as the reference")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--transfers", type=int, default=16, help="round trips per timed round")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--python-only", action="store_true", help="no communication: the transport's own cost")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or the main thread's CPU time")
    args = parser.parse_args(argv)
    if set(args.variants) - set(WIRES):
        parser.error(f"variants are wires: {', '.join(WIRES)}")
    variants = (["baseline"] if args.baseline else []) + list(args.variants or WIRES)
    cfg = {
        "variants": variants, "baseline": args.baseline, "width": args.width, "rows": args.rows,
        "transfers": args.transfers, "rounds": args.rounds, "warmup": args.warmup, "clock": args.clock,
    }
    if args.python_only:
        times = _python_only(cfg)
        variants = [name for name in variants if name in times]
    else:
        times = run_ranks(_rank_main, 2, cfg, timeout_s=600, raise_on_error=True)[0]
    reference = times[variants[0]]
    mode = (", no communication" if args.python_only else "") + (", main thread CPU time" if args.clock == "cpu" else "")
    print(f"{args.rows} x {args.width} float32, {args.rounds} rounds of {args.transfers} round trips (activation + gradient){mode}")
    for name in variants:
        paired = statistics.median(a / b for a, b in zip(times[name], reference))
        print(f"{name:9s} median {statistics.median(times[name]) * 1e6:8.1f} us/round trip   paired / {variants[0]}: {paired:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
