"""The transport's wires on real GPUs: pinned staging over gloo with ranks sharing one GPU,
and NCCL with one communicator per link and direction and its waits on the GPU
(execute/transfer/wires.py, execute/transfer/staging.py, execute/failure.py).

Skipped where torch sees no CUDA device (CI runs the same code paths forced over gloo on
CPU: tests/test_transport_backends.py, tests/test_wire_ordering.py); NCCL between ranks
needs one GPU per rank, so those tests also skip below their rank count. Run them on a GPU
machine with ``pytest tests/test_cuda_transport.py``.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import free_port, run_ranks
from test_transport_backends import GRADIENTS, STEPS, train_worker, worker
from test_wire_ordering import SCHEDULES, SHAPES, check_crossing, crossing_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(300)
def test_ranks_sharing_one_gpu_stage_through_pinned_buffers() -> None:
    """gloo with CUDA tensors (the one-GPU machine): the automatic wire is ``staged``, its
    host buffers are pinned and reused, and every dtype and layout round-trips over a
    2 -> 3 split boundary."""
    results = run_ranks(worker, 5, ("auto",), "cuda:0", timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(5):
        got = results[rank]["auto"]
        assert got["name"] == "staged" and got["pinned"], got
        assert got["checked"] == STEPS if rank >= 2 else got["gradients"] == len(GRADIENTS)
        assert got["allocated"][-1] == got["allocated"][-2], got["allocated"]  # the repeat reused its buffers


def _train_on_gpu(rank: int, world: int) -> dict[str, Any]:
    return train_worker(rank, world, device="cuda:0", wires=("auto",))


@pytest.mark.timeout(300)
def test_training_on_one_shared_gpu_matches_single_process() -> None:
    results = run_ranks(_train_on_gpu, 3, timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(3):
        assert results[rank]["auto"]["name"] == "staged"
        assert results[rank]["auto"]["reference_diff"] < 1e-8, results[rank]["auto"]["reference_diff"]


def _use_nccl(rank: int, world: int, port: int) -> torch.device:
    """Swap the harness's gloo group for NCCL (one GPU per rank, bound to the group as
    Lightning binds it), left as the default group for the harness's closing barrier."""
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.destroy_process_group()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120),
        device_id=device,
    )
    return device


def _nccl_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """The round trips with the automatic wire under NCCL."""
    _use_nccl(rank, world, port)
    senders = tuple(range(world // 2))
    receivers = tuple(range(world // 2, world))
    return worker(rank, world, ("auto",), f"cuda:{rank}", senders, receivers)


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_round_trips_every_dtype() -> None:
    world = min(torch.cuda.device_count(), 5)
    results = run_ranks(_nccl_worker, world, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(world):
        got = results[rank]["auto"]
        assert got["name"] == "nccl" and not got["short"] and not got["ahead"], got
        if rank >= world // 2:
            assert got["checked"] == STEPS and not any(got["posted"])
        else:
            assert got["gradients"] == len(GRADIENTS)


# -- NCCL: no receive waits behind unrelated sends, and no schedule deadlocks ------------------


def _nccl_crossing_worker(rank: int, world: int, port: int) -> list[dict[str, Any]]:
    device = _use_nccl(rank, world, port)
    return crossing_worker(rank, world, str(device))


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between ranks needs two CUDA devices")
def test_every_schedule_runs_through_nccl_with_crossing_traffic() -> None:
    """tests/test_wire_ordering.py's crossing traffic under real NCCL: every schedule on
    every shape that fits the GPUs (two GPUs: two stages; five: all shapes)."""
    world = min(torch.cuda.device_count(), 5)
    results = run_ranks(_nccl_crossing_worker, world, free_port(), timeout_s=540)
    cases = check_crossing(results, world, bound_s=60.0)
    fitting = [sum(len(stage) for stage in devices) for devices in SHAPES.values() if sum(len(stage) for stage in devices) <= world]
    assert cases == len(SCHEDULES) * sum(fitting) and cases > 0


def _middle_stage_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """Ranks 0 -> 1 -> 2. Rank 1 first sends 64 MiB to rank 2 (more than NCCL buffers: the
    send ends only when rank 2 receives it), then receives from rank 0; rank 2 posts its
    receive only once rank 1 says it has received. On a communicator shared by rank 1's
    send and receive, the receive would queue behind the send: a deadlock, which the store
    wait below turns into an error after 60 s."""
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=90)
    transport = Transport(failure, device, links=[(0, 1), (1, 2)])
    store = dist.distributed_c10d._get_default_store()
    rows = (0, 4)

    def big(value: float) -> torch.Tensor:
        return torch.full((4, 1 << 22), value, device=device)

    got = None
    if rank == 0:
        transport.send_activation(big(1.0), rows, [Peer(1, rows)], "activation from rank 0")
    elif rank == 1:
        transport.send_activation(big(2.0), rows, [Peer(2, rows)], "activation to rank 2")
        got = bool((transport.recv_activation(rows, [Peer(0, rows)], "activation from rank 0") == 1.0).all())
        store.set("rank 1 received", "1")
    else:
        store.wait(["rank 1 received"], timedelta(seconds=60))
        got = bool((transport.recv_activation(rows, [Peer(1, rows)], "activation to rank 2") == 2.0).all())
    transport.flush()
    torch.cuda.synchronize()
    failure.close()
    return {"received": got}


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="a middle stage under NCCL needs three CUDA devices")
def test_a_middle_stage_receives_while_its_send_downstream_waits() -> None:
    results = run_ranks(_middle_stage_worker, 3, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    assert results[1]["received"] is True and results[2]["received"] is True, results


def _nccl_train(rank: int, world: int, port: int) -> dict[str, Any]:
    device = _use_nccl(rank, world, port)
    return train_worker(rank, world, device=str(device), wires=("auto",))


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="the 2:1 plan under NCCL needs three CUDA devices")
def test_training_under_nccl_matches_single_process() -> None:
    """A 2:1 plan under NCCL: its transfers, the first stage's gradient buckets and the
    result hand-off all wait on the GPU; the parameters are single-process training's."""
    results = run_ranks(_nccl_train, 3, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in range(3):
        assert results[rank]["auto"]["name"] == "nccl"
        assert results[rank]["auto"]["reference_diff"] < 1e-8, (rank, results[rank]["auto"]["reference_diff"])


# -- NCCL waits on the GPU: the host does not wait, the watchdog still bounds the wait ------------

SLEEP_CYCLES = 4_000_000_000  # about 2 s of one GPU thread at H100 clocks


class _Recorded:
    """A Work whose ``wait`` calls are recorded (a timeout argument would make NCCL's host
    poll every millisecond)."""

    def __init__(self, work: Any, calls: list) -> None:
        self.work, self.calls = work, calls

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.work.wait(*args, **kwargs)


def _host_free_receive_worker(rank: int, world: int, port: int) -> dict[str, Any]:
    """One GPU, one rank: a message to itself (a batched send and receive, which NCCL runs
    on one rank) arrives while a 2 s kernel runs on the compute stream; the nccl wire's
    ``wait`` must return before that kernel ends, having read the flag byte of an
    activation (the host waits for the transfer only) or made the compute stream wait for a
    gradient (the host does not wait at all)."""
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import FLAG_SAME_LAYOUT, pack
    from lightning_dapple.execute.transfer.wires import Incoming, NcclWire

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=60)
    wire = NcclWire(device, failure, links=[])
    payload = torch.arange(1 << 20, dtype=torch.float32, device=device)
    out = {}
    for flagged in (True, False):
        sent = pack([payload], FLAG_SAME_LAYOUT) if flagged else payload.clone()
        torch.cuda.synchronize()  # the message is ready before a stream other than its own sends it
        with wire.reader.issuing():  # a stream with nothing queued, as the wire's own receives
            buffer = torch.empty_like(sent)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, 0), dist.P2POp(dist.irecv, buffer, 0)])
        torch.cuda._sleep(SLEEP_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
        calls: list = []
        incoming = Incoming(0, _Recorded(works[-1], calls), buffer, tuple(buffer.shape), buffer.dtype, flagged)
        start = time.perf_counter()
        ((got, flag),) = wire.wait([incoming], "a message to itself")
        host_s = time.perf_counter() - start
        running = not slept.query()
        values = got[:-1].view(torch.float32) if flagged else got  # read on the compute stream, after the kernel
        same = bool(torch.equal(values, payload))
        torch.cuda.synchronize()
        out["activation" if flagged else "gradient"] = {
            "host_s": host_s, "kernel_running": running, "flag": flag, "same": same, "timeouts": [c for c in calls if c != ((), {})],
        }
    failure.close()
    return out


@pytest.mark.timeout(300)
def test_a_receive_wait_does_not_block_the_host_on_the_compute_stream() -> None:
    results = run_ranks(_host_free_receive_worker, 1, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for kind, got in results[0].items():
        assert got["kernel_running"] and got["host_s"] < 0.5, (kind, got)
        assert got["same"] and got["flag"] == 0 and not got["timeouts"], (kind, got)


def _silent_peer_worker(rank: int, world: int, port: int, out: str) -> dict[str, Any]:
    """Rank 1 never sends the gradient rank 0 receives. Rank 0's receive returns at once
    (the compute stream waits), then its host blocks in a CUDA read that no wait of the
    transport marks: only the watchdog can end it, after ``timeout_s``."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=5.0, poll_s=0.1)
    transport = Transport(failure, device, links=[(0, 1)])
    if rank == 1:
        time.sleep(40)  # alive and beating, never sends
        return {}
    like = [torch.zeros(4, 8, device=device, requires_grad=True)]
    start = time.monotonic()
    grads = transport.recv_gradient(like, (0, 4), [Peer(1, (0, 4))], "gradient 0")
    Path(out).write_text(json.dumps({"returned_s": time.monotonic() - start}))
    float(grads[0].sum())
    return {"survived": True}


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between ranks needs two CUDA devices")
def test_a_peer_that_never_sends_ends_the_job_within_the_timeout(tmp_path: Path, capfd: Any) -> None:
    out = tmp_path / "rank0.json"
    results = run_ranks(_silent_peer_worker, 2, free_port(), str(out), timeout_s=120)
    assert "died with exit code 1" in results["__errors__"][0], results
    assert json.loads(out.read_text())["returned_s"] < 1.0
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("lightning_dapple:")]
    assert len(lines) == 1 and lines[0].startswith(
        "lightning_dapple: rank 0: no progress for 5 s while waiting for gradient 0 from rank 1"
    ), lines


# -- chunked plans under NCCL: a communicator per stream --------------------------------------


def _nccl_chunked(rank: int, world: int, port: int, cases: list) -> list:
    import chunked_worker

    device = _use_nccl(rank, world, port)
    return chunked_worker.run_cases(rank, world, cases, str(device))


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="chunked plans under NCCL need two CUDA devices")
def test_chunked_plans_under_nccl_match_single_process() -> None:
    """Interleaved and ZB-V on 2 GPUs (two stages per rank, each boundary and direction on a
    communicator of its own): the parameters, losses and eval loss of one CPU process."""
    from test_chunked_executor import PLACEMENTS, _check, plan_data

    cases = [(plan_data(schedule, "straight", "never", micro_batches=4), "built", {"wire": "nccl"}) for schedule in PLACEMENTS]
    results = run_ranks(_nccl_chunked, 2, free_port(), cases, timeout_s=240)
    _check(results, cases, list(PLACEMENTS))
