"""Every wire policy of the transport, forced over gloo on CPU (execute/transfer/wires.py).

The ``nccl`` wire's code (a process group per link and direction, the flag byte on every
message, bool and complex as bytes, no receives posted ahead) and the ``staged`` wire's
(every message through the host-buffer pool) run here without a GPU, so CI covers the code
that NCCL and the one-GPU machines run. Five ranks: ranks 0-1 hold a micro-batch's 13 rows as
6 + 7 (a stage of width 2) and ranks 2-4 as 4 + 4 + 5 (width 3), so every transfer is a
DAPPLE 5.2.2 split-concat: receiver 3 takes rows from both senders.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_harness import run_ranks

WIRES = ("gloo", "staged", "nccl")
MIXED = "gloo+staged"  # senders on the gloo wire, receivers staged: the same messages
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


def _activations(rank: int, transport: Any, senders: tuple[int, ...] = SENDERS, receivers: tuple[int, ...] = RECEIVERS) -> dict[str, Any]:
    """Senders send every step; receivers post ahead where they can and check every leaf.
    Tensors live on the transport's device (a GPU in tests/test_cuda_transport.py)."""
    from torch.utils import _pytree as pytree

    from lightning_dapple.execute.slicing import flatten
    from lightning_dapple.execute.transfer.transport import Peer

    device = transport.device
    out: dict[str, Any] = {"checked": 0, "bytes": [], "posted": []}
    for step in range(STEPS):
        total = ROWS.get(step, 13)
        if rank in senders:
            mine = _rows(total, senders, rank)
            part = pytree.tree_map(lambda t: t[mine[0] : mine[1]].detach().to(device).requires_grad_(t.requires_grad), _structure(step, total))
            peers = [Peer(r, _rows(total, receivers, r)) for r in receivers]
            before, batches = transport.bytes_sent, _BATCHES[0]
            transport.send_activation(part, mine, peers, f"step {step}", key=step)
            transport.settle({step})
            out["bytes"].append(transport.bytes_sent - before)
            out.setdefault("batches", []).append(_BATCHES[0] - batches)
            continue
        mine = _rows(total, receivers, rank)
        peers = [Peer(r, _rows(total, senders, r)) for r in senders]
        out["posted"].append(transport.post_activation(mine, peers, f"step {step}") and transport.is_posted(f"step {step}"))
        batches = _BATCHES[0]
        got = transport.recv_activation(mine, peers, f"step {step}")
        out.setdefault("batches", []).append(_BATCHES[0] - batches)
        got_leaves, got_spec = flatten(got)
        want_leaves, want_spec = flatten(_structure(step, total))
        assert got_spec == want_spec, (step, got_spec, want_spec)
        for g, w in zip(got_leaves, want_leaves):
            w = w[mine[0] : mine[1]]
            assert g.dtype == w.dtype and g.shape == w.shape and g.device == device, (step, g.dtype, g.shape, w.dtype, w.shape)
            assert g.requires_grad == w.requires_grad, step
            assert torch.equal(g.detach().cpu(), w.detach()), step
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


def _gradients(rank: int, transport: Any, senders: tuple[int, ...] = SENDERS, receivers: tuple[int, ...] = RECEIVERS) -> dict[str, Any]:
    """Receivers (width 3) send gradients back to the senders (width 2), who check them."""
    from lightning_dapple.execute.transfer.transport import Peer

    device = transport.device
    out: dict[str, Any] = {"checked": 0, "allocated": []}
    stager = getattr(transport.wire, "stager", None)
    for index, dtypes in enumerate(GRADIENTS):
        gen = torch.Generator().manual_seed(200 + index)
        full = [torch.randn(13, 4 + i, generator=gen, dtype=torch.float64).to(d) for i, d in enumerate(dtypes)]
        if rank in receivers:
            mine = _rows(13, receivers, rank)
            peers = [Peer(r, _rows(13, senders, r)) for r in senders]
            transport.send_gradient([g[mine[0] : mine[1]].to(device) for g in full], mine, peers, f"gradient {index}")
            transport.flush()
            out["allocated"].append(stager.pool.allocated if stager is not None else 0)
            continue
        mine = _rows(13, senders, rank)
        like = [torch.zeros(mine[1] - mine[0], 4 + i, dtype=d, device=device, requires_grad=True) for i, d in enumerate(dtypes)]
        peers = [Peer(r, _rows(13, receivers, r)) for r in receivers]
        if index % 2:
            transport.post_gradient(like, mine, peers, f"gradient {index}")
        got = transport.recv_gradient(like, mine, peers, f"gradient {index}")
        for g, w in zip(got, full):
            w = w[mine[0] : mine[1]]
            assert g.dtype == w.dtype and g.shape == w.shape and g.device == device, (index, g.dtype, g.shape)
            assert torch.equal(g.cpu(), w), index
        out["checked"] += 1
        out["allocated"].append(stager.pool.allocated if stager is not None else 0)
    return out


_BATCHES = [0]  # batch_isend_irecv calls in this rank's process


def _count_batches() -> None:
    import torch.distributed as dist

    batch = dist.batch_isend_irecv

    def counted(ops: Any) -> Any:
        _BATCHES[0] += 1
        return batch(ops)

    dist.batch_isend_irecv = counted  # this worker process only


def worker(
    rank: int, world: int, wires: tuple[str, ...] = WIRES, device: str = "cpu", senders: tuple[int, ...] = SENDERS, receivers: tuple[int, ...] = RECEIVERS
) -> dict[str, Any]:
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Transport

    failure = FailureChannel(rank, timeout_s=60)
    _count_batches()
    out: dict[str, Any] = {}
    for wire in wires:  # every rank builds every wire in the same order (nccl's is collective)
        own = wire.split("+")[0 if rank in senders else -1]
        transport = Transport(failure, torch.device(device), wire=own)
        result = {"name": transport.wire.name, "short": transport.short, "ahead": transport.posts_ahead}
        result.update(_activations(rank, transport, senders, receivers))
        gradients = _gradients(rank, transport, senders, receivers)
        result["gradients"] = gradients["checked"]
        result["allocated"] = gradients["allocated"]
        stager = getattr(transport.wire, "stager", None)
        result["pinned"] = stager is not None and stager.pool.pin
        out[wire] = result
    return out


@pytest.mark.timeout(240)
def test_every_wire_round_trips_activations_and_gradients_over_a_split_boundary() -> None:
    results = run_ranks(worker, 5, (*WIRES, MIXED), timeout_s=200)
    assert "__errors__" not in results, results.get("__errors__")
    for wire in (*WIRES, MIXED):
        for rank in RECEIVERS:
            got = results[rank][wire]
            assert got["name"] == wire.split("+")[-1] and got["checked"] == STEPS, (wire, rank, got)
            # receives go ahead once the layout is known, except under NCCL's in-order matching
            assert any(got["posted"]) == (wire != "nccl"), (wire, got["posted"])
            assert not got["posted"][0]  # the first layout is unknown: nothing to post
        for rank in SENDERS:
            got = results[rank][wire]
            assert got["name"] == wire.split("+")[0] and got["gradients"] == len(GRADIENTS), (wire, rank)
            assert got["short"] == (wire != "nccl")
    # a repeated layout costs one message per receiver: the leaves' bytes, plus the flag byte
    # under NCCL (equal sizes); gloo and staged send the same bytes
    for step in REPEATS:
        for rank in SENDERS:
            gloo, nccl = results[rank]["gloo"]["bytes"][step], results[rank]["nccl"]["bytes"][step]
            receivers = 2  # each sender overlaps two of the three receivers
            assert nccl == gloo + receivers, (step, rank, gloo, nccl)
            assert results[rank]["staged"]["bytes"][step] == gloo
    # no wire coalesces messages: a coalesced batch runs on its group's one communicator, where
    # a receive would queue behind unrelated sends (the nccl wire sends each message on its
    # link's communicator, tests/test_wire_ordering.py)
    for rank in range(5):
        for wire in (*WIRES, MIXED):
            assert not any(results[rank][wire]["batches"]), (rank, wire, results[rank][wire]["batches"])
    # host buffers are built per (peer, size) by the first transfer of each size and reused:
    # every gradient transfer of a new size added some, the repeat of the first added none
    for rank in range(5):
        allocated = results[rank]["staged"]["allocated"]
        assert all(b > a for a, b in zip(allocated[:3], allocated[1:4])), (rank, allocated)
        assert allocated[4] == allocated[3], (rank, allocated)


PLAN = {
    "global_batch_size": 12,
    "micro_batches": 3,
    "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2]}],
}
TRAIN_WIRES = ("auto", "gloo", "staged", "nccl")


def train_worker(rank: int, world: int, device: str = "cpu", wires: tuple[str, ...] = TRAIN_WIRES) -> dict[str, Any]:
    """The toy transformer (its boundary: a dict of a float tensor and a bool mask) on a
    2:1 plan, three Adam steps per wire; the parameters after them, and the single-process
    reference's difference from them."""
    import equivalence_worker as ew

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.execute.transfer.transport import Transport
    from lightning_dapple.plan.plan import plan_from_dict

    failure = FailureChannel(rank, timeout_s=60)
    plan = plan_from_dict({**PLAN, "schedule": "dapple"})
    groups = build_groups(plan)
    reference = ew.reference_run("transformer")[0]
    stage = plan.stages[plan.stage_of_rank(rank)]
    out: dict[str, Any] = {}
    for wire in wires:
        model = ew.make_model("transformer")
        local = [model[i].to(device) for i in range(stage.start, stage.end)]
        runner = StageRunner.for_plan(plan, rank, local, torch.device(device), failure, groups=groups, post_ahead=True, ties=())
        if wire != "auto":
            runner.transport = Transport(failure, torch.device(device), wire=wire)
        opt = torch.optim.Adam(runner.parameters, lr=ew.LR)
        for step in range(ew.STEPS):
            batch = tuple(t.to(device) for t in ew.make_batch("transformer", step))
            runner.train_step(batch, ew.Callbacks("transformer"))
            ew.clip_grad_norm_global(runner.parameters, ew.CLIP, stage.replicas, failure, group=groups.plan)
            opt.step()
        runner.finish()
        params = {(stage.start + i, k): v.cpu() for i, layer in enumerate(local) for k, v in layer.state_dict().items()}
        diff = max(float((v - reference[index][k]).abs().max()) for (index, k), v in params.items())
        # plain lists: tensors in the result queue would outlive their sender's shared memory
        out[wire] = {"name": runner.transport.wire.name, "params": {k: v.tolist() for k, v in params.items()}, "reference_diff": diff}
    return out


@pytest.mark.timeout(300)
def test_training_over_every_wire_gives_the_default_wires_parameters() -> None:
    """A 2:1 pipeline (split-concat at its boundary) trained over each forced wire ends with
    exactly the parameters of the default wire, and those of single-process training."""
    results = run_ranks(train_worker, 3, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(3):
        got = results[rank]
        assert got["auto"]["name"] == "gloo"
        assert got["auto"]["reference_diff"] < 1e-10, (rank, got["auto"]["reference_diff"])
        for wire in TRAIN_WIRES[1:]:
            assert got[wire]["name"] == wire
            for key, value in got["auto"]["params"].items():
                assert got[wire]["params"][key] == value, (rank, wire, key)


def test_the_wire_follows_backend_and_device_and_refuses_what_cannot_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.transfer import wires

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    # no process group counts as gloo (what run_ranks and the CPU tests use)
    assert wires.choose_wire("auto", cpu) == "gloo"
    assert wires.choose_wire("auto", cuda) == "staged"  # several ranks on one GPU
    assert wires.choose_wire("nccl", cpu) == "nccl" and wires.choose_wire("staged", cpu) == "staged"
    for wire, device, says in [("gloo", cuda, "cannot send cuda"), ("nccl", cuda, "needs the NCCL backend"), ("tcp", cpu, "one of")]:
        with pytest.raises(DappleConfigError, match=says):
            wires.choose_wire(wire, device)
    # a process group with one backend per device type
    monkeypatch.setattr(wires.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(wires.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert wires.backend_for(cpu) == "gloo" and wires.backend_for(cuda) == "nccl"
    # waits happen on the GPU only where NCCL carries CUDA tensors
    assert wires.waits_on_device(cuda) and not wires.waits_on_device(cpu)
    assert wires.choose_wire("auto", cpu) == "gloo" and wires.choose_wire("auto", cuda) == "nccl"
    monkeypatch.setattr(wires, "backend_for", lambda device: "nccl")
    assert wires.choose_wire("auto", cuda) == "nccl" and wires.choose_wire("nccl", cuda) == "nccl"
    for wire, device in [("staged", cuda), ("gloo", cpu), ("nccl", cpu), ("auto", cpu)]:
        with pytest.raises(DappleConfigError):
            wires.choose_wire(wire, device)


def test_nccl_sends_bool_and_complex_lone_tensors_as_bytes() -> None:
    """NCCL has no bool or complex type: such a lone tensor goes packed (uint8) on that wire;
    gloo sends bool as it is. A lone gradient's receive buffer follows the same rule."""
    from lightning_dapple.execute.transfer.transport import _meta_of, _typed_gradient, as_message, unpack
    from lightning_dapple.execute.transfer.wires import NcclWire, Wire

    flags = torch.tensor([[True, False], [False, True], [True, True]])
    half = torch.randn(3, 2).to(torch.bfloat16)
    assert as_message([flags], Wire.typed) is flags
    message = as_message([flags], NcclWire.typed)
    assert message.dtype == torch.uint8 and torch.equal(unpack(message, [_meta_of(flags)], 3)[0], flags)
    assert as_message([half], NcclWire.typed) is half  # NCCL has bf16
    assert as_message([torch.zeros(3, 1, dtype=torch.complex64)], Wire.typed).dtype == torch.uint8
    assert not _typed_gradient([_meta_of(flags)], NcclWire.typed) and _typed_gradient([_meta_of(half)], NcclWire.typed)


def test_host_buffers_are_reused_and_flag_bytes_come_back_zeroed() -> None:
    """The staging pool lends one buffer per key at a time and reuses it; a flagged
    (activation) buffer's last byte is zero again when it is lent (a short message leaves it
    as it was, and the receiver must read "same layout" then)."""
    from lightning_dapple.execute.transfer.staging import Stager

    stager = Stager(torch.device("cpu"))
    key = ("recv", 1, 9, True)
    first = stager.pool.take(key, 9, zeroed=True)
    first.fill_(7)
    stager.pool.give(key, first)
    again = stager.pool.take(key, 9, zeroed=True)
    assert again.data_ptr() == first.data_ptr() and int(again[-1]) == 0 and stager.pool.allocated == 1
    other = stager.pool.take(key, 9, zeroed=True)  # the first is still lent: a second buffer
    assert other.data_ptr() != again.data_ptr() and stager.pool.allocated == 2
    values = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    (host,) = stager.to_host([(values, ("send", 2, 24))])
    back = stager.to_device(host, (3, 2), torch.float32, ("send", 2, 24))
    assert torch.equal(back, values) and stager.pool.take(("send", 2, 24), 24).data_ptr() == host.data_ptr()


def test_short_messages_cannot_be_forced_on_the_nccl_wire() -> None:
    """NCCL needs every receive to match its message's size: asking the nccl wire for gloo's
    short messages is refused before anything is sent."""
    import torch.distributed as dist

    from dist_harness import free_port
    from lightning_dapple.errors import DappleConfigError
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Transport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    failure = FailureChannel(0, timeout_s=10)
    try:
        assert Transport(failure, torch.device("cpu"), wire="nccl").short is False
        assert Transport(failure, torch.device("cpu"), wire="staged", short_messages=False).short is False
        with pytest.raises(DappleConfigError, match="nccl wire needs every message"):
            Transport(failure, torch.device("cpu"), wire="nccl", short_messages=True)
    finally:
        failure.close()
        dist.destroy_process_group()


# -- the nccl wire's waits on the GPU are bounded from the side (execute/failure.py) ----------
# CUDA events stand-ins: the watchdog only calls query() (device waits) and the host's
# synchronize() (values it must read), so the bounds show on CPU.


class _Never:
    """An event whose work never completes: a peer that never sends."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        import threading

        threading.Event().wait()  # blocked for good, as in cudaEventSynchronize


class _Done:
    def query(self) -> bool:
        return True


def device_wait_worker(rank: int, world: int, mode: str) -> dict:
    import time

    from lightning_dapple.execute.failure import FailureChannel

    channel = FailureChannel(rank, timeout_s=2.0 if mode != "peer-failed" else 30.0, poll_s=0.05, grace_s=1.0)
    start = time.monotonic()
    if mode == "completed":
        for index in range(100):
            channel.watch(_Done(), f"gradient {index} from rank 1")
        time.sleep(1.0)
        left = len(channel._watched)
        channel.close()
        return {"left": left}
    if mode == "peer-failed" and rank == 0:
        channel.report(RuntimeError("deliberate failure"))
        time.sleep(8)  # reported, but stays alive (and keeps serving the store)
        return {}
    if mode in ("watch", "peer-failed"):
        channel.watch(_Never(), "gradient 3 from rank 1")
        time.sleep(20)  # the host goes on; only the watchdog sees the device wait
    else:
        channel.block_on(_Never(), "the flag byte of activation 2 from rank 1")
    return {"survived_s": time.monotonic() - start}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "what"), [("watch", "gradient 3 from rank 1"), ("block", "the flag byte of activation 2 from rank 1")])
def test_a_device_wait_that_never_completes_ends_the_job_within_the_timeout(mode: str, what: str, capfd: Any) -> None:
    """A receive the compute stream waits for (the host went on), or a value the host waits
    for in CUDA: either way the watchdog ends the process after ``timeout_s`` and says what
    it was waiting for, once."""
    import time

    start = time.monotonic()
    results = run_ranks(device_wait_worker, 1, mode, timeout_s=45)
    assert "died with exit code 1" in results["__errors__"][0], results
    assert time.monotonic() - start < 15  # timeout_s is 2 s; the worker alone would live 20 s or forever
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("lightning_dapple:")]
    assert lines == [f"lightning_dapple: rank 0: no progress for 2 s while waiting for {what}; a peer may be stuck or dead. "
                     "Raise DappleStrategy(timeout_s=...) if steps are this slow.; rank 0 exits"], lines


@pytest.mark.timeout(60)
def test_completed_device_waits_are_dropped_and_end_nothing() -> None:
    results = run_ranks(device_wait_worker, 1, "completed", timeout_s=45, raise_on_error=True)
    assert results[0] == {"left": 0}


@pytest.mark.timeout(60)
def test_a_stalled_device_wait_counts_as_blocked_after_a_peers_report(capfd: Any) -> None:
    """Rank 0 reports a failure and stays alive; rank 1's host is not blocked, but its
    device waits (for rank 0, say): its watchdog ends it after ``grace_s``, not ``timeout_s``."""
    results = run_ranks(device_wait_worker, 2, "peer-failed", timeout_s=45)
    assert "died with exit code 1" in results["__errors__"][1], results
    # the grace rule's line (the timeout's would say "no progress for 30 s")
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("lightning_dapple:")]
    assert lines == [
        "lightning_dapple: rank 0 raised RuntimeError: deliberate failure (seen on rank 1, blocked 1 s in gradient 3 from rank 1); "
        "rank 1 exits"
    ], lines
