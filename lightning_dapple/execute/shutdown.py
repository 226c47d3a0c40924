"""Destroy the process groups at exit, while the interpreter can still run their clean-up.

Lightning registers an exit-time ``destroy_process_group`` only for NCCL; under gloo the
groups live until the interpreter finalizes. gloo's worker threads own the ``Work`` of every
collective (the executor's per-stage gradient AllReduce, DAPPLE 5.2.3, and Lightning's own
broadcasts) and drop it after the rank's ``wait()`` has returned -- on a loaded machine, a
descheduled worker drops it much later. Dropping it releases tensors that have Python
objects, which needs the GIL; during finalization that ends the thread by a forced unwind
through C++ code that may not be unwound, and the process dies with SIGABRT ("terminate
called without an active exception") after training succeeded; CI met it twice. A core
dump of a reproduction (two ranks exiting with all-reduces still queued) shows that stack:
``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
``gil_scoped_acquire`` -> ``pthread_exit`` -> ``std::terminate``.

Destroying the groups in an ``atexit`` handler, after their owners have dropped their
references (a group still referenced keeps its threads), joins those threads while the
interpreter is whole. It is skipped after a failure: a peer that is gone can keep a
collective (and so the join) waiting, and a failing rank must exit promptly (see ``failure``).
"""
from __future__ import annotations

import atexit
import gc
from typing import Callable

import torch.distributed as dist

# (failed, release) per owner: whether a rank failed; drop the owner's group references
_owners: list[tuple[Callable[[], bool], Callable[[], None]]] = []
_registered = False


def destroy_groups_at_exit(failed: Callable[[], bool], release: Callable[[], None]) -> None:
    """At exit, unless some owner's ``failed()`` is true, call every owner's ``release()``
    and destroy all process groups. One handler per process; each call adds an owner."""
    global _registered
    _owners.append((failed, release))
    if not _registered:
        atexit.register(destroy_groups)
        _registered = True


def destroy_groups() -> None:
    """The exit handler: release the owners' groups, destroy them all, collect the garbage
    that still references them (their destructors join gloo's threads)."""
    owners, _owners[:] = list(_owners), []
    if not dist.is_available() or not dist.is_initialized():
        return
    if any(failed() for failed, _ in owners):
        return
    for _, release in owners:
        release()
    dist.destroy_process_group()
    gc.collect()
