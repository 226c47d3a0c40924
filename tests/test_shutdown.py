"""The exit handler that destroys process groups (execute/shutdown.py), without processes:
which owners it releases, and when it leaves the groups alone."""
from __future__ import annotations

import gc
import weakref

from lightning_dapple.execute import shutdown


class Owner:
    def __init__(self, failed: bool = False) -> None:
        self.failed = failed
        self.released = 0

    def exit_failed(self) -> bool:
        return self.failed

    def release_groups(self) -> None:
        self.released += 1


def test_live_owners_are_released_and_held_weakly() -> None:
    kept, dropped = Owner(), Owner()
    shutdown.destroy_groups_at_exit(dropped)
    shutdown.destroy_groups_at_exit(kept)
    shutdown.destroy_groups_at_exit(kept)  # registering again does not duplicate
    probe = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert probe() is None  # the handler did not keep it alive
    assert [ref() for ref in shutdown._owners if ref() is not None] == [kept]
    shutdown.destroy_groups()  # no process group here: releases all the same
    assert kept.released == 1
    assert shutdown._owners == []


def test_the_latest_owner_decides_whether_a_failure_skips_the_release() -> None:
    failed_earlier, fine_later = Owner(failed=True), Owner()
    shutdown.destroy_groups_at_exit(failed_earlier)
    shutdown.destroy_groups_at_exit(fine_later)
    shutdown.destroy_groups()
    assert (failed_earlier.released, fine_later.released) == (1, 1)

    fine_earlier, failed_later = Owner(), Owner(failed=True)
    shutdown.destroy_groups_at_exit(fine_earlier)
    shutdown.destroy_groups_at_exit(failed_later)
    shutdown.destroy_groups()
    assert (fine_earlier.released, failed_later.released) == (0, 0)

    # registering an earlier owner again makes it the latest
    shutdown.destroy_groups_at_exit(failed_later)
    shutdown.destroy_groups_at_exit(fine_earlier)
    shutdown.destroy_groups_at_exit(failed_later)
    shutdown.destroy_groups()
    assert (fine_earlier.released, failed_later.released) == (0, 0)


# -- after a failure: NCCL communicators aborted, nothing destroyed ---------------------------


class _Backend:
    def __init__(self, name: str, calls: list) -> None:
        self.name = name
        self.calls = calls

    def abort(self) -> None:
        self.calls.append(("abort", self.name))

    def _group_start(self) -> None:
        self.calls.append(("group_start", self.name))

    def _group_end(self) -> None:
        self.calls.append(("group_end", self.name))


class _Group:
    def __init__(self, name: str, backend: str, calls: list) -> None:
        self.name = name
        self.backend = backend
        self.nccl = _Backend(name, calls)

    def _get_backend(self, device):
        if "nccl" not in self.backend:
            raise RuntimeError("no backend for cuda")
        return self.nccl


def _fake_world(monkeypatch, calls: list) -> list:
    """A default NCCL group, an NCCL subgroup, a gloo subgroup (checkpoint parts) and a mixed
    one; destroying any of them is recorded."""
    from types import SimpleNamespace

    import torch.distributed as dist

    groups = [_Group("default", "nccl", calls), _Group("replicas", "nccl", calls), _Group("parts", "gloo", calls), _Group("mixed", "cpu:gloo,cuda:nccl", calls)]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: (group or groups[0]).backend)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: groups[0])
    monkeypatch.setattr(dist.distributed_c10d, "_world", SimpleNamespace(pg_map={group: None for group in groups[::-1]}))

    def destroy(group=None) -> None:
        calls.append(("destroy", group))

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    return groups


def test_a_failed_exit_aborts_the_nccl_backends_in_one_group_call_and_destroys_nothing(monkeypatch) -> None:
    """A failing rank's NCCL work may never be matched (its peer left): destroying the groups
    would wait for it, so their NCCL backends are aborted (in one NCCL group call, default
    group first), gloo's left alone, and Lightning's exit-time destroy is unregistered."""
    import atexit

    from lightning.fabric.utilities import distributed as lightning_distributed

    calls: list = []
    _fake_world(monkeypatch, calls)
    unregistered = []
    monkeypatch.setattr(atexit, "unregister", lambda fn: unregistered.append(fn))
    failed = Owner(failed=True)  # held: the handler holds owners weakly
    shutdown.destroy_groups_at_exit(failed)
    shutdown.destroy_groups()
    assert calls == [
        ("group_start", "default"), ("abort", "default"), ("abort", "mixed"), ("abort", "replicas"), ("group_end", "default"),
    ]
    assert lightning_distributed._destroy_dist_connection in unregistered


def test_a_clean_exit_destroys_and_aborts_nothing(monkeypatch) -> None:
    calls: list = []
    _fake_world(monkeypatch, calls)
    owner = Owner()
    shutdown.destroy_groups_at_exit(owner)
    shutdown.destroy_groups()
    assert calls == [("destroy", None)] and owner.released == 1


def test_the_strategys_exit_after_a_failure_aborts(monkeypatch) -> None:
    """The strategy as the owner: a failure its channel saw makes the exit handler abort."""
    from types import SimpleNamespace

    from lightning_dapple.strategy.dapple_strategy import DappleStrategy

    calls: list = []
    _fake_world(monkeypatch, calls)
    strategy = DappleStrategy()
    strategy.failure = SimpleNamespace(known_failed=True)
    shutdown.destroy_groups_at_exit(strategy)
    shutdown.destroy_groups()
    assert ("abort", "replicas") in calls and not any(call[0] == "destroy" for call in calls)
    strategy.failure = None


def test_the_handler_runs_before_lightnings_destroy(monkeypatch) -> None:
    """Exit handlers run last registered first: registering an owner moves the handler after
    whatever Lightning registered when it opened the default group."""
    import atexit

    order: list = []
    monkeypatch.setattr(atexit, "register", lambda fn: order.append(("register", fn)))
    monkeypatch.setattr(atexit, "unregister", lambda fn: order.append(("unregister", fn)))
    owner = Owner()
    shutdown.destroy_groups_at_exit(owner)
    shutdown.destroy_groups_at_exit(owner)
    assert order == [("unregister", shutdown.destroy_groups), ("register", shutdown.destroy_groups)] * 2
    shutdown._owners.clear()
