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
interpreter is whole. Owners (strategies) are held weakly, so a finished Trainer is not kept
alive until exit. The most recently registered owner decides whether to skip: after a failure
a peer that is gone can keep a collective (and so the join) waiting, and a failing rank must
exit promptly (see ``failure``). Under NCCL, Lightning registers its own exit-time destroy,
which runs whatever this handler decides.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

import torch.distributed as dist

# owners (held weakly), oldest first; each has ``exit_failed()`` and ``release_groups()``
_owners: list[weakref.ref] = []
_registered = False


def destroy_groups_at_exit(owner: Any) -> None:
    """At exit, unless ``owner.exit_failed()`` (asked of the latest owner), call every live
    owner's ``release_groups()`` and destroy all process groups. One handler per process;
    registering an owner again makes it the latest."""
    global _registered
    _owners[:] = [ref for ref in _owners if ref() is not None and ref() is not owner]
    _owners.append(weakref.ref(owner))
    if not _registered:
        atexit.register(destroy_groups)
        _registered = True


def destroy_groups() -> None:
    """The exit handler: release the owners' groups, destroy them all, and collect the
    garbage that still references them (their destructors join gloo's threads). Runs the
    release even when the user destroyed the default group already, since subgroups the
    owners hold would keep their threads."""
    owners = [owner for owner in (ref() for ref in _owners) if owner is not None]
    _owners.clear()
    if owners and owners[-1].exit_failed():
        return
    for owner in owners:
        owner.release_groups()
    del owners
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
