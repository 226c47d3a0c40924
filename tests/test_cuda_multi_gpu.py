"""What a desk review of the NCCL paths predicts for the first node with several GPUs, as
tests that run there (docs/gpus.md lists each prediction and its reasoning).

Every test needs two CUDA devices (one rank per GPU, NCCL between them) and skips below
that, as on CI and on a one-GPU machine; ``bash scripts/gpu_check.sh`` runs them, one at a
time, when it finds several GPUs. The CPU side of each mechanism is tested in CI:
tests/test_nccl_review.py, tests/test_nccl_watched_waits.py, tests/test_nccl_communicators.py,
tests/test_shutdown.py.

* crossing link traffic while a kernel that fills every SM runs on another stream: both
  directions of a link complete, right, within a bound (communicators progress at once);
* sync BatchNorm and the replicas' gradient buckets under NCCL (their waits on the GPU)
  train as one process does;
* a rank blocked in an NCCL wait while its peer has failed ends within the failure
  channel's grace, with and without ``TORCH_NCCL_BLOCKING_WAIT=1``;
* a failing rank with unmatched NCCL work (a send nobody receives) exits at once: its
  communicators are aborted, not destroyed (``execute/shutdown.py``);
* the communicators a plan makes, counted on the GPU, and the device memory they take
  against the memory model's estimate (``plan/communicators.py``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import free_port, run_ranks
from test_cuda_transport import _use_nccl

ROOT = Path(__file__).resolve().parents[1]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between ranks needs two CUDA devices")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), TWO_GPUS]

ROWS = (0, 8)
MICRO_BATCHES = 6
LOAD_MATMULS = 150  # 8192 x 8192 bf16 matmuls per micro-batch on a side stream: every SM busy


def _crossing_under_load(rank: int, world: int, port: int) -> dict[str, Any]:
    """Ranks 0 and 1 send each other 32 MiB per micro-batch at the same time (an activation
    one way, a gradient the other: each direction its own communicator) while a side stream
    runs matmuls that fill the GPU. Returns how many receives held what was sent, and the
    seconds taken with and without the load."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=120)
    transport = Transport(failure, device, links=[(0, 1)])
    side = torch.cuda.Stream(device)
    left = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) / 90
    out = torch.empty_like(left)
    timings, checked = {}, 0
    for loaded in (False, True):
        torch.cuda.synchronize()
        started = time.monotonic()
        for mb in range(MICRO_BATCHES):
            if loaded:
                with torch.cuda.stream(side):
                    for _ in range(LOAD_MATMULS):
                        torch.mm(left, left, out=out)
            value = torch.full((8, 1 << 20), float(10 * mb + rank), device=device)
            if rank == 0:
                transport.send_activation(value, ROWS, [Peer(1, ROWS)], f"activation {loaded} {mb}")
                got = transport.recv_gradient([value], ROWS, [Peer(1, ROWS)], f"gradient {loaded} {mb}")[0]
            else:
                transport.send_gradient([value], ROWS, [Peer(0, ROWS)], f"gradient {loaded} {mb}")
                got = transport.recv_activation(ROWS, [Peer(0, ROWS)], f"activation {loaded} {mb}")
            checked += int(bool((got.detach() == float(10 * mb + 1 - rank)).all()))
        transport.flush()
        torch.cuda.synchronize()
        timings[loaded] = time.monotonic() - started
    failure.close()
    return {"checked": checked, "seconds": timings}


@pytest.mark.timeout(300)
def test_crossing_link_traffic_completes_while_a_kernel_fills_the_gpu() -> None:
    results = run_ranks(_crossing_under_load, 2, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    for rank in (0, 1):
        assert results[rank]["checked"] == 2 * MICRO_BATCHES, results
        assert results[rank]["seconds"][True] < 120, results  # slower under load, never stuck


def _batchnorm_buckets(rank: int, world: int, port: int) -> dict[str, Any]:
    """One stage on two replicas (GPUs 0 and 1), sync BatchNorm, out-of-order backprop and
    recomputation, gradient buckets of 256 bytes (many AllReduces): its state after the
    steps, to compare with one process."""
    import batchnorm_worker as bw

    from lightning_dapple.execute.batchnorm import convert_batchnorm
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.groups import build_groups
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=120)
    plan = plan_from_dict({
        "global_batch_size": bw.ROWS, "micro_batches": 2, "schedule": "dapple", "ooo": True,
        "stages": [{"layers": [0, 5], "devices": [0, 1], "recompute": "always"}],
    })
    groups = build_groups(plan)
    model = bw.make_model().to(device)
    convert_batchnorm(model, list(model), groups.replicas.get(0), rank, 2, sync=True, deferred=False)
    runner = StageRunner.for_plan(plan, rank, list(model), device, failure, groups=groups, ties=(), bucket_bytes=256)
    optimizer = torch.optim.Adam(runner.parameters, lr=bw.LR)
    for step in range(bw.STEPS):
        runner.train_step(tuple(t.to(device) for t in bw.make_batch(step)), bw.Callbacks())
        optimizer.step()
    runner.finish()
    failure.close()
    return {index: {k: v.cpu().numpy().copy() for k, v in layer.state_dict().items()} for index, layer in enumerate(model)}


@pytest.mark.timeout(300)
def test_sync_batchnorm_and_replica_buckets_under_nccl_train_as_one_process() -> None:
    import batchnorm_worker as bw

    results = run_ranks(_batchnorm_buckets, 2, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    reference, _ = bw.reference_run("sync", 2, 2)
    for rank in (0, 1):
        for index, state in results[rank].items():
            expected = reference[index].state_dict()
            for key, value in state.items():
                assert float((torch.as_tensor(value).double() - expected[key].double()).abs().max()) < 1e-8, (rank, index, key)
    for index, state in results[0].items():  # replicas bit-identical
        assert all((value == results[1][index][key]).all() for key, value in state.items())


GRACE_S = 2.0


def _blocked_under_nccl(rank: int, world: int, port: int, mode: str, blocking: str) -> str:
    """Rank 1 fails (publishes its error, stays alive); rank 0 is blocked waiting for it
    under NCCL: a receive from it (``receive``), or a sync BatchNorm's statistics
    (``batchnorm``). ``blocking``: TORCH_NCCL_BLOCKING_WAIT, under which ``Work.wait()``
    blocks the host."""
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = blocking
    import torch.distributed as dist
    from torch import nn

    from lightning_dapple.execute.batchnorm import StageBuffers, convert_batchnorm
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.process_groups import subgroup
    from lightning_dapple.execute.transfer.transport import Peer, Transport

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=100, grace_s=GRACE_S, poll_s=0.1)
    transport = Transport(failure, device, links=[(1, 0)]) if mode == "receive" else None
    layers = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(device)
    if mode == "batchnorm":
        group = subgroup([0, 1])
        convert_batchnorm(layers, list(layers), group, rank, 2, sync=True, deferred=False)
        StageBuffers(list(layers), group, 0, rank, 2, failure, 0)
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(1.5)
        failure.report(RuntimeError("stage 1 failed"))
        time.sleep(100)
        return "the failing rank woke up"
    if mode == "receive":
        transport.recv_activation(ROWS, [Peer(1, ROWS)], "activation from rank 1")
    else:
        layers(torch.randn(5, 3, device=device))
    torch.cuda.synchronize()  # the host meets the stalled GPU wait here, if not before
    return "returned"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("blocking", ["0", "1"])
@pytest.mark.parametrize("mode", ["receive", "batchnorm"])
def test_a_rank_blocked_in_an_nccl_wait_ends_within_the_grace(mode: str, blocking: str) -> None:
    started = time.monotonic()
    results = run_ranks(_blocked_under_nccl, 2, free_port(), mode, blocking, timeout_s=150)
    elapsed = time.monotonic() - started
    assert results.get("__errors__", {}).get(0, "").startswith("rank 0 died with exit code 1"), results
    assert elapsed < 60, elapsed  # NCCL's own timeout (120 s) would be later


EXIT_SCRIPT = textwrap.dedent('''
    import atexit, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from lightning.fabric.utilities.distributed import _destroy_dist_connection
    from lightning_dapple.execute.process_groups import subgroup
    from lightning_dapple.execute.shutdown import destroy_groups_at_exit

    rank, port = int(sys.argv[1]), sys.argv[2]
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60), device_id=device)
    atexit.register(_destroy_dist_connection)  # what Lightning registers for NCCL

    class FailedOwner:  # a strategy whose rank failed
        def exit_failed(self):
            return True

        def release_groups(self):
            pass

    owner = FailedOwner()
    destroy_groups_at_exit(owner)
    pair = subgroup([0, 1])
    big = torch.ones(64 << 20, device=device)  # 256 MiB, more than NCCL buffers
    dist.barrier()
    if rank == 1:
        dist.isend(big, 0, group=pair)  # rank 0 never receives it
        time.sleep(1)
        print("rank 1 fails", flush=True)
        sys.exit(3)
    time.sleep(60)
''')


@pytest.mark.timeout(200)
def test_a_failing_rank_with_unmatched_nccl_work_exits_at_once(tmp_path: Path) -> None:
    script = tmp_path / "exit_rank.py"
    script.write_text(EXIT_SCRIPT)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), port], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        out, _ = ranks[1].communicate(timeout=90)  # set-up included
        assert "rank 1 fails" in out, out
        assert ranks[1].returncode == 3, out
    finally:
        for process in ranks:
            process.kill()
            process.wait(timeout=30)


def _communicator_memory(rank: int, world: int, port: int) -> dict[str, Any]:
    """A 1:1 plan's groups under NCCL (the default, two link groups), each used once: the
    device memory the links' communicators took, per communicator."""
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.transfer.transport import Transport

    device = _use_nccl(rank, world, port)
    failure = FailureChannel(rank, timeout_s=120)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    Transport(failure, device, links=[(0, 1)])  # two communicators, each connected by its first message
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(device)[0]
    failure.close()
    return {"per_communicator_bytes": (free_before - free_after) / 2}


@pytest.mark.timeout(300)
def test_a_links_communicators_take_no_more_memory_than_the_model_prices() -> None:
    from lightning_dapple.plan.communicators import NCCL_COMMUNICATOR_BYTES

    results = run_ranks(_communicator_memory, 2, free_port(), timeout_s=240)
    assert "__errors__" not in results, results.get("__errors__")
    measured = [results[rank]["per_communicator_bytes"] for rank in (0, 1)]
    print(f"device memory per link communicator: {[round(m / 2**20) for m in measured]} MiB")
    assert all(m <= 2 * NCCL_COMMUNICATOR_BYTES for m in measured), measured
