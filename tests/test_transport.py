"""Activation transfers: one message per transfer once the layout is known, and a correct
hand-over whenever the layout changes (execute/transport.py, DAPPLE 5.2.2 split-concat).

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
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.slicing import flatten
    from lightning_dapple.execute.transport import Peer, Transport

    transport = Transport(FailureChannel(rank, timeout_s=60), torch.device("cpu"))
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
    assert results[1]["checked"] == results[2]["checked"] == STEPS
    messages = results[0]["messages"]
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

    from lightning_dapple.execute.transport import _spec_from_bytes, _spec_to_bytes

    t = torch.zeros(2, 1)
    for value, kind in [(t, b"J"), ((t, t), b"J"), ({"hidden": t, "extra": [t, t]}, b"J"), (HiddenAndMask(t, t), b"P")]:
        spec = pytree.tree_flatten(value)[1]
        raw = _spec_to_bytes(spec)
        assert raw[:1] == kind, value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _spec_from_bytes(raw) == spec
