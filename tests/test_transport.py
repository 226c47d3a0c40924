"""Activation transfers: one message per transfer once the layout is known, and a correct
hand-over whenever the layout changes (execute/transfer/transport.py, DAPPLE 5.2.2 split-concat).

Three ranks: rank 0 holds all rows of a micro-batch, ranks 1 and 2 hold half each (an
uneven-width boundary, so every transfer is split). Rank 0 sends a sequence whose layout
changes in every way the executor meets -- requires_grad on and off (training vs eval),
an extra leaf, a new pytree structure, a new row count -- and repeats layouts in between.
The receivers check every value, dtype and requires_grad flag against a deterministic
reference, and rank 0 checks how many messages each transfer cost.
"""
from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

from dist_harness import run_ranks


def _reference(step: int, rows: int) -> Any:
    """The structure sent at ``step`` (all ``rows`` rows), the same on every rank."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(rows, 4, generator=gen, dtype=torch.float64)
    mask = torch.randint(0, 5, (rows, 3), generator=gen)
    if step in (0, 1, 7, 8):
        return x.requires_grad_(True)
    if step == 2:
        return x  # eval: nothing requires grad
    if step in (3, 4):
        return (x.requires_grad_(True), mask)
    return {"hidden": x.requires_grad_(True), "mask": mask}  # steps 5, 6 (6: more rows)


HiddenAndMask = collections.namedtuple("HiddenAndMask", "hidden mask")  # module level: picklable
ROWS = {6: 10}  # step 6 changes the micro-batch size
STEPS = 9
SAME_LAYOUT = (1, 4, 8)  # repeats of the previous transfer's layout


def worker(rank: int, world: int) -> dict:
    """Both activation protocols (gloo's short messages, and the flag byte on every message
    that NCCL needs), gradients of one and of two leaves, and the gloo behaviour the short
    protocol relies on."""
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import short_messages_match

    failure = FailureChannel(rank, timeout_s=60)
    out: dict[str, Any] = {"short_default": short_messages_match()}
    # gloo: a message shorter than the receive posted for it leaves the buffer's tail as it was
    if rank == 0:
        dist.isend(torch.arange(4, dtype=torch.float32), 1).wait()
    elif rank == 1:
        buffer = torch.full((17,), 0xAB, dtype=torch.uint8)
        dist.irecv(buffer, 0).wait()
        out["short_tail"] = int(buffer[-1])
        out["short_head"] = buffer[:16].view(torch.float32).tolist()
    for short in (True, False):
        out[short] = _activations(rank, failure, short)
    out["gradients"] = _gradients(rank, failure)
    return out


def _gradients(rank: int, failure: Any) -> int:
    """Ranks 1 and 2 (half the rows each) send gradients of one and of two leaves to rank 0."""
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    transport = Transport(failure, torch.device("cpu"))
    checked = 0
    for leaves in (1, 2):
        like = [torch.zeros(6, 4 + i, dtype=torch.float64, requires_grad=True) for i in range(leaves)]
        full = [torch.randn(6, 4 + i, generator=torch.Generator().manual_seed(10 + i), dtype=torch.float64) for i in range(leaves)]
        halves = [Peer(1, (0, 3)), Peer(2, (3, 6))]
        if rank == 0:
            got = transport.recv_gradient(like, (0, 6), halves, f"gradient {leaves}")
            assert all(torch.equal(g, w) for g, w in zip(got, full)), leaves
            checked += 1
        else:
            mine = halves[rank - 1].rows
            transport.send_gradient([g[mine[0] : mine[1]] for g in full], mine, [Peer(0, (0, 6))], f"gradient {leaves}")
            transport.flush()
    return checked


def _activations(rank: int, failure: Any, short: bool) -> dict:
    from lightning_dapple.execute.slicing import flatten
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    transport = Transport(failure, torch.device("cpu"), short_messages=short)
    out: dict[str, Any] = {"messages": [], "checked": 0}
    for step in range(STEPS):
        rows = ROWS.get(step, 6)
        half = rows // 2
        receivers = [Peer(1, (0, half)), Peer(2, (half, rows))]
        if rank == 0:
            before = transport.messages_sent
            transport.send_activation(_reference(step, rows), (0, rows), receivers, f"step {step}")
            transport.flush()
            out["messages"].append(transport.messages_sent - before)
            continue
        mine = receivers[rank - 1].rows
        got = transport.recv_activation(mine, [Peer(0, (0, rows))], f"step {step}")
        want = _reference(step, rows)
        got_leaves, got_spec = flatten(got)
        want_leaves, want_spec = flatten(want)
        assert got_spec == want_spec, (step, got_spec, want_spec)
        for g, w in zip(got_leaves, want_leaves):
            w = w[mine[0] : mine[1]]
            assert g.dtype == w.dtype and g.shape == w.shape, (step, g.dtype, g.shape, w.dtype, w.shape)
            assert g.requires_grad == w.requires_grad, (step, g.requires_grad)
            assert torch.equal(g.detach(), w.detach()), step
        out["checked"] += 1
    return out


@pytest.mark.timeout(120)
def test_layouts_change_and_repeat_over_a_split_boundary() -> None:
    results = run_ranks(worker, 3, timeout_s=100)
    assert "__errors__" not in results, results.get("__errors__")
    assert results[0]["short_default"] is True  # gloo
    assert results[1]["short_tail"] == 0xAB and results[1]["short_head"] == [0.0, 1.0, 2.0, 3.0]
    assert results[0]["gradients"] == 2
    for short in (True, False):
        assert results[1][short]["checked"] == results[2][short]["checked"] == STEPS, short
        messages = results[0][short]["messages"]
        for step in SAME_LAYOUT:
            assert messages[step] == 2, f"step {step}: a known layout must cost one message per receiver, not {messages[step]}"
        # the first transfer: header + structure + data per receiver; later changes add the
        # message that tells the receiver to read a header
        assert messages[0] == 6
        assert messages[2] == 2 * 3  # filler, header, data (the structure did not change)
        assert messages[3] == 2 * 4  # filler, header, structure, data


def test_structures_travel_as_pytree_json_and_namedtuples_by_pickle() -> None:
    """Layer-output structures round-trip; the common ones (tensor, tuple, dict, list) go as
    pytree's JSON, so the receiver never unpickles a deprecated leaf spec (a FutureWarning on
    every layout change before), and node types JSON cannot name still travel."""
    import warnings

    from torch.utils import _pytree as pytree

    from lightning_dapple.execute.transfer.transport import _spec_from_bytes, _spec_to_bytes

    t = torch.zeros(2, 1)
    for value, kind in [(t, b"J"), ((t, t), b"J"), ({"hidden": t, "extra": [t, t]}, b"J"), (HiddenAndMask(t, t), b"P")]:
        spec = pytree.tree_flatten(value)[1]
        raw = _spec_to_bytes(spec)
        assert raw[:1] == kind, value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _spec_from_bytes(raw) == spec


def test_awkward_layouts_pack_and_lone_tensors_go_as_they_are() -> None:
    """Leaves whose flattened view is not a dense byte range (an expanded, stride-0 gradient;
    a column slice; a transpose) pack and unpack exactly; a lone tensor is sent as itself
    (contiguous) unless it is complex, which travels as bytes (NCCL has no complex type)."""
    from lightning_dapple.execute.transfer.transport import _meta_of, as_message, pack, unpack

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    leaves = [torch.ones(3, 1).expand(3, 4), base[:, 0], base.t().contiguous().t(), base.double()]
    message = as_message(leaves)
    assert message.dtype == torch.uint8
    for got, want in zip(unpack(pack(leaves), [_meta_of(t) for t in leaves], 3), leaves):
        assert torch.equal(got, want)
    assert torch.equal(unpack(message, [_meta_of(t) for t in leaves], 3)[1], base[:, 0])
    column = as_message([base[:, 1]])
    assert column.dtype == torch.float32 and column.is_contiguous() and torch.equal(column, base[:, 1])
    assert as_message([base]) is base  # no copy
    assert as_message([torch.zeros(3, 2, dtype=torch.complex64)]).dtype == torch.uint8
