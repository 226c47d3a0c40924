"""Every wire policy of the transport, forced over gloo on CPU (execute/wires.py).

The ``nccl`` wire's code (batched p2p, the flag byte on every message, bool and complex as
bytes, no receives posted ahead, its own process groups) and the ``staged`` wire's (every
message through the host-buffer pool) run here without a GPU, so CI covers the code that
NCCL and the one-GPU machines run. Five ranks: ranks 0-1 hold a micro-batch's 13 rows as
6 + 7 (a stage of width 2) and ranks 2-4 as 4 + 4 + 5 (width 3), so every transfer is a
DAPPLE 5.2.2 split-concat: receiver 3 takes rows from both senders.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_harness import run_ranks

WIRES = ("gloo", "staged", "nccl")
SENDERS, RECEIVERS = (0, 1), (2, 3, 4)


def _rows(total: int, ranks: tuple[int, ...], rank: int) -> tuple[int, int]:
    from lightning_dapple.execute.slicing import row_range

    return row_range(total, len(ranks), ranks.index(rank))


def _structure(step: int, rows: int) -> Any:
    """What the senders send at ``step`` (all rows; each sender sends its own): layouts that
    change in dtype, leaf count, structure and row count, with repeats in between."""
    gen = torch.Generator().manual_seed(100 + step)
    h = torch.randn(rows, 3, 2, generator=gen)
    if step in (0, 1):
        return {
            "h": h.requires_grad_(True),
            "mask": torch.rand(rows, 5, generator=gen) > 0.5,
            "ids": torch.randint(-9, 9, (rows, 2), generator=gen),
            "c": torch.randn(rows, 2, generator=gen, dtype=torch.complex64),
            "b": torch.randn(rows, 4, generator=gen).to(torch.bfloat16),
        }
    if step == 2:
        return torch.rand(rows, 3, generator=gen) > 0.5  # a lone bool tensor
    if step == 3:
        return torch.randn(rows, 2, generator=gen, dtype=torch.complex128)
    if step in (4, 5, 9):
        return torch.randn(rows, 6, generator=gen).to(torch.bfloat16).requires_grad_(True)
    return (h.double().requires_grad_(True), torch.randint(0, 7, (rows,), generator=gen, dtype=torch.int32), h.half())


ROWS = {8: 11}  # step 8 changes the micro-batch size
STEPS = 10
REPEATS = (1, 5, 7, 8)  # the previous step's layout (8: with fewer rows); 9 goes back to step 4's


def _activations(rank: int, transport: Any) -> dict[str, Any]:
    """Senders send every step; receivers post ahead where they can and check every leaf."""
    from lightning_dapple.execute.slicing import flatten
    from lightning_dapple.execute.transport import Peer

    out: dict[str, Any] = {"checked": 0, "bytes": [], "posted": []}
    for step in range(STEPS):
        total = ROWS.get(step, 13)
        if rank in SENDERS:
            mine = _rows(total, SENDERS, rank)
            whole = _structure(step, total)
            part = {k: v[mine[0] : mine[1]] for k, v in whole.items()} if isinstance(whole, dict) else (
                tuple(v[mine[0] : mine[1]] for v in whole) if isinstance(whole, tuple) else whole[mine[0] : mine[1]]
            )
            peers = [Peer(r, _rows(total, RECEIVERS, r)) for r in RECEIVERS]
            before = transport.bytes_sent
            transport.send_activation(part, mine, peers, f"step {step}", key=step)
            transport.settle({step})
            out["bytes"].append(transport.bytes_sent - before)
            continue
        mine = _rows(total, RECEIVERS, rank)
        peers = [Peer(r, _rows(total, SENDERS, r)) for r in SENDERS]
        out["posted"].append(transport.post_activation(mine, peers, f"step {step}") and transport.is_posted(f"step {step}"))
        got = transport.recv_activation(mine, peers, f"step {step}")
        got_leaves, got_spec = flatten(got)
        want_leaves, want_spec = flatten(_structure(step, total))
        assert got_spec == want_spec, (step, got_spec, want_spec)
        for g, w in zip(got_leaves, want_leaves):
            w = w[mine[0] : mine[1]]
            assert g.dtype == w.dtype and g.shape == w.shape, (step, g.dtype, g.shape, w.dtype, w.shape)
            assert g.requires_grad == w.requires_grad, step
            assert torch.equal(g.detach(), w.detach()), step
        out["checked"] += 1
    transport.flush()
    return out


GRADIENTS = [
    [torch.float32],
    [torch.bfloat16],
    [torch.complex64],
    [torch.float64, torch.float16],
    [torch.float32],  # a repeat: the staging pool is reused, not grown
]


def _gradients(rank: int, transport: Any) -> dict[str, Any]:
    """Receivers (width 3) send gradients back to the senders (width 2), who check them."""
    from lightning_dapple.execute.transport import Peer

    out: dict[str, Any] = {"checked": 0, "allocated": []}
    stager = getattr(transport.wire, "stager", None)
    for index, dtypes in enumerate(GRADIENTS):
        gen = torch.Generator().manual_seed(200 + index)
        full = [torch.randn(13, 4 + i, generator=gen, dtype=torch.float64).to(d) for i, d in enumerate(dtypes)]
        if rank in RECEIVERS:
            mine = _rows(13, RECEIVERS, rank)
            peers = [Peer(r, _rows(13, SENDERS, r)) for r in SENDERS]
            transport.send_gradient([g[mine[0] : mine[1]] for g in full], mine, peers, f"gradient {index}")
            transport.flush()
            out["allocated"].append(stager.pool.allocated if stager is not None else 0)
            continue
        mine = _rows(13, SENDERS, rank)
        like = [torch.zeros(mine[1] - mine[0], 4 + i, dtype=d, requires_grad=True) for i, d in enumerate(dtypes)]
        peers = [Peer(r, _rows(13, RECEIVERS, r)) for r in RECEIVERS]
        if index % 2:
            transport.post_gradient(like, mine, peers, f"gradient {index}")
        got = transport.recv_gradient(like, mine, peers, f"gradient {index}")
        for g, w in zip(got, full):
            w = w[mine[0] : mine[1]]
            assert g.dtype == w.dtype and g.shape == w.shape, (index, g.dtype, g.shape)
            assert torch.equal(g, w), index
        out["checked"] += 1
        out["allocated"].append(stager.pool.allocated if stager is not None else 0)
    return out


def worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transport import Transport

    failure = FailureChannel(rank, timeout_s=60)
    out: dict[str, Any] = {}
    for wire in WIRES:  # every rank builds every wire in the same order (nccl's is collective)
        transport = Transport(failure, torch.device("cpu"), wire=wire)
        result = {"name": transport.wire.name, "short": transport.short, "ahead": transport.posts_ahead}
        result.update(_activations(rank, transport))
        gradients = _gradients(rank, transport)
        result["gradients"] = gradients["checked"]
        result["allocated"] = gradients["allocated"]
        out[wire] = result
    return out


@pytest.mark.timeout(240)
def test_every_wire_round_trips_activations_and_gradients_over_a_split_boundary() -> None:
    results = run_ranks(worker, 5, timeout_s=200)
    assert "__errors__" not in results, results.get("__errors__")
    for wire in WIRES:
        for rank in RECEIVERS:
            got = results[rank][wire]
            assert got["name"] == wire and got["checked"] == STEPS, (wire, rank, got)
            # receives go ahead once the layout is known, except under NCCL's in-order matching
            assert any(got["posted"]) == (wire != "nccl"), (wire, got["posted"])
            assert not got["posted"][0]  # the first layout is unknown: nothing to post
        for rank in SENDERS:
            got = results[rank][wire]
            assert got["gradients"] == len(GRADIENTS), (wire, rank)
            assert got["short"] == (wire != "nccl")
    # a repeated layout costs one message per receiver: the leaves' bytes, plus the flag byte
    # under NCCL (equal sizes); gloo and staged send the same bytes
    for step in REPEATS:
        for rank in SENDERS:
            gloo, nccl = results[rank]["gloo"]["bytes"][step], results[rank]["nccl"]["bytes"][step]
            receivers = 2  # each sender overlaps two of the three receivers
            assert nccl == gloo + receivers, (step, rank, gloo, nccl)
            assert results[rank]["staged"]["bytes"][step] == gloo
    # host buffers are built per (peer, size) by the first transfer of each size and reused:
    # every gradient transfer of a new size added some, the repeat of the first added none
    for rank in range(5):
        allocated = results[rank]["staged"]["allocated"]
        assert all(b > a for a, b in zip(allocated[:3], allocated[1:4])), (rank, allocated)
        assert allocated[4] == allocated[3], (rank, allocated)
