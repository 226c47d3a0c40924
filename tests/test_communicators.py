"""NCCL communicators per rank (``plan/communicators.py``) for the shapes that make many:
replicated stages with a tied embedding, interleaved chunks, a fan-out from one device to
seven; each count is the one the executor's group builders make (the link pairs are checked
against ``execute/transfer/links.py``), within the stated cap, and priced as memory where asked."""
from __future__ import annotations

import pytest

from lightning_dapple.cluster import GIB, Cluster
from lightning_dapple.execute.transfer.links import plan_links, plan_streams
from lightning_dapple.plan.communicators import (
    NCCL_COMMUNICATOR_BYTES,
    communicator_cap,
    communicator_groups,
    communicator_memory,
    communicator_reserve_bytes,
    communicators_per_rank,
)
from lightning_dapple.plan.evaluate import score_stages
from lightning_dapple.plan.plan import Plan, StagePlan, chunk_placement
from lightning_dapple.profile.model_profile import (
    LayerProfile,
    ModelProfile,
    TiedParams,
)


def _links(plan: Plan) -> set[tuple[int, int, int]]:
    """The executor's link keys (``wires.link_groups``): (low rank, high rank, boundary or -1)."""
    if plan.chunks > 1:
        return {(min(a, b), max(a, b), k) for a, b, k in plan_streams(plan)}
    return {(min(a, b), max(a, b), -1) for a, b in plan_links(plan)}


def _check(plan: Plan, ties: tuple = ()) -> dict[int, int]:
    counts = communicators_per_rank(plan, ties)
    links = [members for kind, members in communicator_groups(plan, ties) if kind.startswith("link")]
    assert len(links) == 2 * len(_links(plan))  # one group per link (or stream) and direction
    assert sorted(set(links)) == sorted({(a, b) for a, b, _ in _links(plan)})
    cap = communicator_cap(plan, ties)
    assert all(counts[rank] <= cap[rank] for rank in counts), (counts, cap)
    return counts


def test_two_stages_of_four_replicas_with_a_tied_embedding() -> None:
    """Replica i of one stage shares rows with replica i of the next only: one link each.
    Per rank: the default group, its replica group, the tie's group over all eight ranks,
    and its link's two directions."""
    plan = Plan(64, 4, (StagePlan((0, 6), (0, 1, 2, 3)), StagePlan((6, 12), (4, 5, 6, 7)))).validate()
    tie = TiedParams(layers=(0, 11), param_bytes=1e6)
    counts = _check(plan, (tie,))
    assert counts == dict.fromkeys(range(8), 5)
    kinds = [kind for kind, _ in communicator_groups(plan, (tie,))]
    assert kinds.count("replicas") == 2 and kinds.count("tied") == 1 and kinds.count("default") == 1
    assert communicator_cap(plan, (tie,)) == dict.fromkeys(range(8), 7)  # 1 + 1 + 1 tie + 2 x (ceil(4/4) + 1)
    assert communicators_per_rank(plan, (tie,), wire="gloo") == dict.fromkeys(range(8), 3)  # no link groups off NCCL
    assert communicators_per_rank(plan) == dict.fromkeys(range(8), 4)  # a tie on one stage needs no group


def test_interleaved_eight_groups_of_four_chunks() -> None:
    """32 stages on 8 ranks (stage k on rank k mod 8): every boundary between two ranks is a
    stream of its own, so a middle rank has 4 streams out and 4 in, 16 groups, against 4 for
    the same ranks without chunks."""
    stages = tuple(StagePlan((k, k + 1), (group,)) for k, group in enumerate(chunk_placement("interleaved", 8, 4)))
    plan = Plan(64, 8, stages, schedule="interleaved").validate()
    counts = _check(plan)
    assert counts == {0: 15, 1: 17, 2: 17, 3: 17, 4: 17, 5: 17, 6: 17, 7: 15}
    straight = Plan(64, 8, tuple(StagePlan((k, k + 1), (k,)) for k in range(8))).validate()
    assert _check(straight) == {0: 3, **dict.fromkeys(range(1, 7), 5), 7: 3}
    assert max(communicator_cap(plan).values()) == 33  # 1 + 4 chunks x 2 neighbours x 2 directions x (ceil(1/1) + 1)


def test_a_fan_out_from_one_device_to_seven() -> None:
    """One rank feeds seven replicas: it shares rows with every one of them (14 groups), and
    its memory holds 15 communicators, 8.2 GB at NVIDIA/nccl#964's 544 MB each."""
    plan = Plan(56, 2, (StagePlan((0, 1), (0,)), StagePlan((1, 4), tuple(range(1, 8))))).validate()
    counts = _check(plan)
    assert counts == {0: 15, **dict.fromkeys(range(1, 8), 4)}
    assert communicator_cap(plan) == {0: 1 + 2 * (7 + 1), **dict.fromkeys(range(1, 8), 1 + 1 + 2 * (1 + 1))}
    memory = communicator_memory(plan, NCCL_COMMUNICATOR_BYTES)
    assert memory == [15 * 544e6, 4 * 544e6]
    assert communicator_memory(plan, 0.0) == [0.0, 0.0]


def test_a_plan_on_part_of_the_world_adds_its_own_group() -> None:
    plan = Plan(8, 2, (StagePlan((0, 1), (0,)), StagePlan((1, 2), (1,)))).validate()
    assert communicators_per_rank(plan, world_size=4) == {0: 4, 1: 4, 2: 1, 3: 1}


def test_the_reserve_counts_only_on_nccl_gpus() -> None:
    assert communicator_reserve_bytes("cuda", "nccl") == 544e6
    assert communicator_reserve_bytes("cpu", "gloo") == 0.0
    assert communicator_reserve_bytes("cuda", "gloo") == 0.0  # ranks sharing a GPU: staged over gloo


def test_the_memory_model_adds_the_reserve_where_asked() -> None:
    profile = ModelProfile(4, tuple(LayerProfile(f"l{i}", 1.0, 2.0, 1e3, 1e6, 1e3) for i in range(4)))
    cluster = Cluster(1, 8, device_memory_gib=16.0)
    stages = (StagePlan((0, 1), (0,)), StagePlan((1, 4), tuple(range(1, 8))))
    plain = score_stages(profile, cluster, stages, 56, 2)
    priced = score_stages(profile, cluster, stages, 56, 2, communicator_bytes=NCCL_COMMUNICATOR_BYTES)
    assert [b - a for a, b in zip(plain.prediction.memory_bytes, priced.prediction.memory_bytes)] == pytest.approx([15 * 544e6, 4 * 544e6])
    tight = Cluster(1, 8, device_memory_gib=7.5)
    assert score_stages(profile, tight, stages, 56, 2).fits(tight)
    assert not score_stages(profile, tight, stages, 56, 2, communicator_bytes=NCCL_COMMUNICATOR_BYTES).fits(tight)  # 8.16 GB > 7.5 GiB
    assert 15 * NCCL_COMMUNICATOR_BYTES > 7.5 * GIB
