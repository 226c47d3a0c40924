"""The end-of-step hand-off of the loss and logged objects (execute/results.py), and the rule
that decides where receives are posted ahead (execute/transport.receives_ahead_pay).

Three ranks: rank 0 is the first stage, ranks 1 and 2 the two replicas of the last stage
(rank 1 is the source). Every rank must get the summed loss and both replicas' objects in
replica order; the source must not wait for slow receivers.
"""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from dist_harness import free_port, run_ranks

PLAN = {
    "global_batch_size": 4,
    "micro_batches": 1,
    "stages": [{"layers": [0, 1], "devices": [0]}, {"layers": [1, 2], "devices": [1, 2]}],
}
SLOW_S = 1.5


def worker(rank: int, world: int) -> dict[str, Any]:
    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.results import ResultChannel
    from lightning_dapple.plan.plan import plan_from_dict

    plan = plan_from_dict(PLAN)
    channel = ResultChannel(plan, rank, torch.device("cpu"), FailureChannel(rank, timeout_s=30))
    out: dict[str, Any] = {"by_tag": channel.by_tag}
    is_last = rank in (1, 2)
    # 1: losses and objects from both replicas, head receive posted at "step start"
    channel.post()
    own = torch.tensor(0.25 * rank, dtype=torch.float64) if is_last else torch.zeros((), dtype=torch.float64)
    loss, gathered = channel.share(own, {"rank": rank, "values": list(range(rank))} if is_last else None)
    out["first"] = (float(loss), gathered)
    # 2: nothing logged: no payload travels, every replica's slot is None
    loss, gathered = channel.share(own, None)
    out["second"] = (float(loss), gathered)
    # 3: rank 0 arrives late; the source must not wait for it
    if rank == 0:
        time.sleep(SLOW_S)
    started = time.perf_counter()
    loss, gathered = channel.share(own, None)
    out["third"] = (float(loss), time.perf_counter() - started)
    # 4: objects only (an eval pass's extras): no loss anywhere
    loss, gathered = channel.share(None, f"replica {rank}" if is_last else None)
    out["fourth"] = (loss, gathered)
    channel.flush()
    return out


@pytest.mark.timeout(120)
def test_every_rank_gets_the_summed_loss_and_objects_and_the_source_does_not_wait() -> None:
    results = run_ranks(worker, 3, timeout_s=90)
    assert "__errors__" not in results, results.get("__errors__")
    total = 0.25 * 1 + 0.25 * 2
    for rank in range(3):
        got = results[rank]
        assert got["by_tag"] is True  # gloo: the head receive was posted early
        loss, gathered = got["first"]
        assert loss == pytest.approx(total, abs=1e-15)
        assert gathered == [{"rank": 1, "values": [0]}, {"rank": 2, "values": [0, 1]}]
        assert got["second"] == (pytest.approx(total, abs=1e-15), [None, None])
        assert got["third"][0] == pytest.approx(total, abs=1e-15)
        assert got["fourth"] == (None, ["replica 1", "replica 2"])
    # the source (and the other last-stage replica, which only waits for the source) went on
    # while rank 0 slept; rank 0 itself waited for nothing either: the head had arrived
    assert results[1]["third"][1] < SLOW_S / 3, results[1]["third"]
    assert results[2]["third"][1] < SLOW_S / 3, results[2]["third"]


def test_receives_are_posted_ahead_only_under_gloo_with_a_core_to_spare_or_in_merged_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_dapple.execute.transfer import transport

    cpu = torch.device("cpu")
    assert not transport.receives_ahead_pay(cpu, local_ranks=1, threads=1)  # no process group
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(transport.os, "cpu_count", lambda: 2)
        assert not transport.receives_ahead_pay(cpu, local_ranks=2, threads=1)  # 2 ranks x (1 + loop) > 2 cores
        assert transport.receives_ahead_pay(cpu, local_ranks=1, threads=1)
        # a merged order of several stages per rank posts ahead whenever every rank has a core
        assert transport.receives_ahead_pay(cpu, local_ranks=2, threads=1, merged_order=True)
        assert not transport.receives_ahead_pay(cpu, local_ranks=4, threads=1, merged_order=True)
        monkeypatch.setattr(transport.os, "cpu_count", lambda: 16)
        assert transport.receives_ahead_pay(cpu, local_ranks=4, threads=2)  # 4 x 3 <= 16
        assert not transport.receives_ahead_pay(cpu, local_ranks=4, threads=4)  # 4 x 5 > 16
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # the launcher's count of ranks on this machine
        assert transport.receives_ahead_pay(cpu, threads=1)  # 8 x 2 = 16: fits exactly
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "9")
        assert not transport.receives_ahead_pay(cpu, threads=1)
    finally:
        dist.destroy_process_group()
    # NCCL orders a pair's operations on one stream: posting ahead could deadlock there
    assert not transport.receives_ahead_pay(torch.device("cuda", 0), local_ranks=1, threads=1)
