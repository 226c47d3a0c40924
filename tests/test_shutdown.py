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
