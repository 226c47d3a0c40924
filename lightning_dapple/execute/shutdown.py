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
alive until exit. The most recently registered owner decides whether the exit follows a
failure (its own or a peer's, see ``failure``); then the groups are not destroyed, since a
peer that is gone can keep a collective (and so the join) waiting, and a failing rank must
exit promptly:

* gloo groups are left to the process's end. Neither ``abort()`` nor ``shutdown()`` of a
  gloo group returns before its pending work does (checked on torch 2.13: an ``abort()``
  with an unmatched receive posted returned only when the peer left);
* NCCL backends are aborted (``Backend.abort()``, which ``ncclCommAbort``s the
  communicators without waiting for their kernels), all within one NCCL group call, as
  ``torch.distributed``'s own abort of every group does (an abort was a collective in some
  NCCL releases). Lightning registers an exit-time ``destroy_process_group`` for NCCL, which
  would wait for the unmatched work a failure leaves (a send whose receiver left, a
  collective a peer never joined): after the abort it is unregistered. This handler is
  registered again with each owner, so it runs before Lightning's (exit handlers run last
  registered first).
"""
from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist

# owners (held weakly), oldest first; each has ``exit_failed()`` and ``release_groups()``
_owners: list[weakref.ref] = []


def destroy_groups_at_exit(owner: Any) -> None:
    """At exit, unless ``owner.exit_failed()`` (asked of the latest owner), call every live
    owner's ``release_groups()`` and destroy all process groups. One handler per process;
    registering an owner again makes it the latest."""
    _owners[:] = [ref for ref in _owners if ref() is not None and ref() is not owner]
    _owners.append(weakref.ref(owner))
    atexit.unregister(destroy_groups)  # once, and after Lightning's (so it runs first)
    atexit.register(destroy_groups)


def destroy_groups() -> None:
    """The exit handler: release the owners' groups, destroy them all, and collect the
    garbage that still references them (their destructors join gloo's threads). Runs the
    release even when the user destroyed the default group already, since subgroups the
    owners hold would keep their threads."""
    owners = [owner for owner in (ref() for ref in _owners) if owner is not None]
    _owners.clear()
    if owners and owners[-1].exit_failed():
        abort_nccl_groups()
        return
    for owner in owners:
        owner.release_groups()
    del owners
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def abort_nccl_groups() -> int:
    """After a failure: abort the NCCL backend of every process group (gloo's left as they
    are) and unregister Lightning's exit-time destroy; how many backends were aborted."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    backends = [backend for backend in (_nccl_backend(group) for group in _live_groups()) if backend is not None]
    if not backends:
        return 0
    default = _nccl_backend(dist.distributed_c10d._get_default_group())
    grouped = default is not None and hasattr(default, "_group_start")
    if grouped:
        default._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        if grouped:
            default._group_end()
    lightning = sys.modules.get("lightning.fabric.utilities.distributed")
    destroy = getattr(lightning, "_destroy_dist_connection", None)
    if destroy is not None:
        atexit.unregister(destroy)
    return len(backends)


def _live_groups() -> list[Any]:
    """Every process group of this process, the default one first."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    default = dist.distributed_c10d._get_default_group()
    return [default, *(group for group in groups if group is not default)]


def _nccl_backend(group: Any) -> Any:
    """``group``'s NCCL backend (the CUDA half of a mixed group), or None."""
    try:
        if "nccl" not in str(dist.get_backend(group)).lower():
            return None
        return group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError, AttributeError):
        return None
