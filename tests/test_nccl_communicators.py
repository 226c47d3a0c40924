"""What the executor's process groups and messages will be under NCCL, counted on gloo.

* Communicators: every process group the executor makes is an NCCL communicator on each of
  its members. Each rank counts the groups it really joins while its runner is built
  (``dist.new_group`` spied, the default group included) for plans of 2 stages x 2
  replicas with a tied embedding and an interleaved plan on the same ranks, and the count
  must equal ``plan.communicators.communicators_per_rank``, which the memory model prices.
* Timeouts: every one of those groups gets the default group's timeout.
* Message sizes: gloo accepts a message shorter than the receive posted for it; NCCL needs
  both ends to agree. ``SizeLedger`` records, per (group, sender, receiver), the bytes of
  every message sent and every receive posted, in order; both ends must list the same
  sizes. It runs on those plans' training steps and on every schedule's crossing traffic
  through the ``nccl`` wire (tests/test_wire_ordering.py's workers), and it does catch a
  short message (the last test).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from dist_harness import run_ranks

WORLD = 4
GPT = [[0, 1], [1, 3], [3, 4], [4, 5]]  # the tied GPT's 5 layers in four stages (interleaved)
CASES = {
    "2x2 tied": {
        "global_batch_size": 12, "micro_batches": 2, "schedule": "dapple",
        "stages": [{"layers": [0, 3], "devices": [0, 1]}, {"layers": [3, 5], "devices": [2, 3]}],
    },
    "interleaved 2x2 tied": {
        "global_batch_size": 12, "micro_batches": 4, "schedule": "interleaved",
        "stages": [{"layers": cut, "devices": [[0, 1], [2, 3]][k % 2]} for k, cut in enumerate(GPT)],
    },
    "3:1 tied": {
        "global_batch_size": 12, "micro_batches": 2, "schedule": "dapple",
        "stages": [{"layers": [0, 4], "devices": [0, 1, 2]}, {"layers": [4, 5], "devices": [3]}],
    },
}
STEPS = 2


class SizeLedger:
    """Bytes of every point-to-point message this process sends and every receive it posts,
    per (group, sender, receiver), in issue order (``dist.isend``/``dist.irecv`` wrapped in
    this process only). NCCL matches a pair's i-th send with its i-th receive on one
    communicator and needs their sizes equal; gloo does not check."""

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.sent: dict[str, list[int]] = {}
        self.posted: dict[str, list[int]] = {}
        for name, book in (("isend", self.sent), ("irecv", self.posted)):
            original = getattr(dist, name)

            def recorded(tensor: torch.Tensor, peer: int, *args: Any, _call: Any = original, _book: dict = book, _sends: bool = name == "isend", **kwargs: Any) -> Any:
                group = kwargs.get("group")
                where = "default" if group is None else group.group_name
                key = f"{where}:{self.rank}->{peer}" if _sends else f"{where}:{peer}->{self.rank}"
                _book.setdefault(key, []).append(tensor.numel() * tensor.element_size())
                return _call(tensor, peer, *args, **kwargs)

            setattr(dist, name, recorded)

    def books(self) -> dict[str, dict[str, list[int]]]:
        return {"sent": self.sent, "posted": self.posted}


def mismatched_sizes(books: list[dict[str, dict[str, list[int]]]]) -> list[tuple[str, list[int], list[int]]]:
    """Where the sizes a sender sent differ from the receives its receiver posted, over
    every rank's ledger: (group:sender->receiver, sent, posted)."""
    sent: dict[str, list[int]] = {}
    posted: dict[str, list[int]] = {}
    for book in books:
        for key, sizes in book["sent"].items():
            sent.setdefault(key, []).extend(sizes)
        for key, sizes in book["posted"].items():
            posted.setdefault(key, []).extend(sizes)
    return [(key, sent.get(key, []), posted.get(key, [])) for key in sorted(set(sent) | set(posted)) if sent.get(key) != posted.get(key)]


class GroupsJoined:
    """Counts the groups ``dist.new_group`` makes that this rank belongs to, and the timeout
    each call passes (this process only)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.joined = 0
        self.timeouts: list[Any] = []
        original = dist.new_group

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = original(*args, **kwargs)
            self.timeouts.append(kwargs.get("timeout"))
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                self.joined += 1
            return group

        dist.new_group = counted


class _GPTCallbacks:
    def make_input(self, batch: Any) -> Any:
        return batch[0]

    def compute_loss(self, batch: Any, forward: Any) -> torch.Tensor:
        from tied_models import gpt_loss

        return gpt_loss(forward(batch[0]), batch[1])


def _held_layers(plan: Any, rank: int) -> list[torch.nn.Module]:
    """This rank's layers of a fresh tied GPT, the others freed (the tie kept), as the strategy holds them."""
    from lightning_dapple.strategy.tied_layers import KeptTensors, free_layer
    from tied_models import tied_gpt_layers

    model = tied_gpt_layers()
    held = [i for stage in plan.stages_of_rank(rank) for i in range(plan.stages[stage].start, plan.stages[stage].end)]
    kept = KeptTensors(model[i] for i in held)
    for other in [i for i in range(len(model)) if i not in held]:
        free_layer(model[other], kept)
    return [model[i] for i in held]


def counting_worker(rank: int, world: int) -> dict[str, Any]:
    """Per case: the groups this rank joined building its runner (plus the default group)
    and the timeouts they got; then STEPS training steps over the ``nccl`` wire; then the
    crossing traffic of every schedule; the message ledger of it all."""
    import torch.distributed as dist

    from lightning_dapple.execute.failure import FailureChannel
    from lightning_dapple.execute.process_groups import default_timeout
    from lightning_dapple.execute.runner import StageRunner
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.profile.ties import tied_parameters
    from test_wire_ordering import crossing_worker
    from tied_models import gpt_batch, tied_gpt_layers

    ledger = SizeLedger(rank)
    joined = GroupsJoined()
    failure = FailureChannel(rank, timeout_s=60)
    ties = tied_parameters(list(tied_gpt_layers()))
    out: dict[str, Any] = {"default_timeout": default_timeout().total_seconds(), "cases": {}}
    for name, data in CASES.items():
        plan = plan_from_dict(data)
        before, joined.timeouts = joined.joined, []
        runner = StageRunner.for_plan(plan, rank, _held_layers(plan, rank), torch.device("cpu"), failure, ties=ties, wire="nccl")
        communicators = 1 + joined.joined - before  # the default group, and what this runner made
        timeouts = [t.total_seconds() if isinstance(t, timedelta) else t for t in joined.timeouts]
        optimizer = torch.optim.Adam(runner.parameters, lr=1e-2)
        for step in range(STEPS):
            runner.train_step(gpt_batch(step), _GPTCallbacks())
            optimizer.step()
            optimizer.zero_grad()
        runner.finish()
        dist.barrier()
        out["cases"][name] = {"communicators": communicators, "timeouts": timeouts, "wire": runner.transport.wire.name}
    failure.close()
    out["crossing"] = crossing_worker(rank, world)
    out["ledger"] = ledger.books()
    return out


@pytest.fixture(scope="module")
def counted() -> dict[Any, Any]:
    results = run_ranks(counting_worker, WORLD, timeout_s=400)
    assert "__errors__" not in results, results.get("__errors__")
    return results


@pytest.mark.timeout(480)
def test_each_rank_joins_the_communicators_the_plan_counts(counted: dict[Any, Any]) -> None:
    from lightning_dapple.plan.communicators import communicators_per_rank
    from lightning_dapple.plan.plan import plan_from_dict
    from lightning_dapple.profile.ties import tied_parameters
    from tied_models import tied_gpt_layers

    ties = tied_parameters(list(tied_gpt_layers()))
    for name, data in CASES.items():
        expected = communicators_per_rank(plan_from_dict(data), ties, WORLD, wire="nccl")
        really = {rank: counted[rank]["cases"][name]["communicators"] for rank in range(WORLD)}
        assert really == expected, (name, really, expected)
        assert all(counted[rank]["cases"][name]["wire"] == "nccl" for rank in range(WORLD))


@pytest.mark.timeout(480)
def test_every_group_the_executor_makes_gets_the_default_groups_timeout(counted: dict[Any, Any]) -> None:
    for rank in range(WORLD):
        default = counted[rank]["default_timeout"]
        assert default == 400  # run_ranks opens the default group with its timeout_s
        for name, case in counted[rank]["cases"].items():
            assert case["timeouts"] and all(timeout == default for timeout in case["timeouts"]), (rank, name, case["timeouts"])


@pytest.mark.timeout(480)
def test_both_ends_of_every_message_agree_on_its_size(counted: dict[Any, Any]) -> None:
    """Training steps with replicas, a tie and interleaving, and every schedule's crossing
    traffic, through the ``nccl`` wire: no message shorter or longer than its receive."""
    from test_wire_ordering import check_crossing

    assert check_crossing({rank: counted[rank]["crossing"] for rank in range(WORLD)}, WORLD, bound_s=60.0) > 0
    books = [counted[rank]["ledger"] for rank in range(WORLD)]
    assert sum(len(sizes) for book in books for sizes in book["sent"].values()) > 100
    assert mismatched_sizes(books) == []


def _short_message_worker(rank: int, world: int) -> dict[str, dict[str, list[int]]]:
    """A 12-byte message into a 16-byte receive: gloo takes it, the ledger records both."""
    import torch.distributed as dist

    ledger = SizeLedger(rank)
    group = dist.new_group([0, 1])
    if rank == 0:
        dist.isend(torch.zeros(3), 1, group=group).wait()
    else:
        dist.irecv(torch.zeros(4), 0, group=group).wait()
    return ledger.books()


@pytest.mark.timeout(120)
def test_the_ledger_catches_a_message_shorter_than_its_receive() -> None:
    results = run_ranks(_short_message_worker, 2, timeout_s=60)
    assert "__errors__" not in results, results.get("__errors__")
    [(key, sent, posted)] = mismatched_sizes([results[0], results[1]])
    assert key.endswith(":0->1") and (sent, posted) == ([12], [16])
