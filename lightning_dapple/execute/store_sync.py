"""Waiting for another rank's own work, through the job's store: rank 0's plan, Lightning's
barriers and broadcasts, and the rare exchange of what every rank holds.

A process-group collective waits at most the group's timeout (``timeout_s``). That suits the
pipeline's transfers, whose two ends reach them within a step of each other, but not a rank
that waits while another works alone: rank 0 profiling and planning (``plan="auto"``), or
rank 0 writing a checkpoint while the others wait in Lightning's barrier after
``save_checkpoint``. Under DDP such waits may last the launcher's 30 minutes; asking users to
size ``timeout_s`` by their slowest checkpoint write would trade away the quick detection of
stuck transfers. So these waits go through the store, as long as the peers take (up to
Lightning's default 30 minutes, ``failure.LONG_WAIT_S``), while the failure channel watches
that they live (``FailureChannel.wait_until``): a peer's error, its death or its silence
ends every rank, within ``unresponsive_s``.

Every rank makes the same calls in the same order; each call's keys are numbered by a
per-rank counter kept in the store itself, so the numbers agree across fits of one job, and
the last rank through a call deletes its keys.
"""
from __future__ import annotations

import pickle
from typing import Any

from lightning_dapple.execute.failure import FailureChannel

__all__ = ["StoreSync"]

PREFIX = "lightning_dapple/sync"


class StoreSync:
    """Barriers and rank-0 broadcasts over the store of ``failure``'s job (module docstring)."""

    def __init__(self, failure: FailureChannel) -> None:
        self.failure = failure
        self.store = failure.store
        self.rank, self.world_size = failure.rank, failure.world_size

    def _next_key(self, what: str) -> str:
        number = int(self.failure.on_store(lambda: self.store.add(f"{PREFIX}/calls/{self.rank}", 1), what))
        return f"{PREFIX}/{number}"

    def _leave(self, key: str, what: str, *extra: str) -> None:
        """Count this rank out of call ``key``; the last one out deletes its keys."""

        def leave() -> None:
            if int(self.store.add(f"{key}/left", 1)) == self.world_size:
                for name in (*extra, f"{key}/left"):
                    self.store.delete_key(name)

        self.failure.on_store(leave, what)

    def barrier(self, name: str) -> None:
        """Return once every rank has arrived at this barrier (``name`` says which, in messages)."""
        what = f"the other ranks at barrier {name!r}"
        key = self._next_key(what)
        arrived = f"{key}/arrived"
        self.failure.on_store(lambda: self.store.add(arrived, 1), what)
        self.failure.wait_until(lambda: int(self.store.add(arrived, 0)) >= self.world_size, what)
        self._leave(key, what, arrived)

    def broadcast(self, payload: Any, what: str, src: int = 0) -> Any:
        """``payload`` of rank ``src`` on every rank (pickled; the others' ``payload`` is ignored)."""
        what = f"{what} from rank {src}"
        key = self._next_key(what)
        data = f"{key}/data"
        if self.rank == src:
            self.failure.on_store(lambda: self.store.set(data, pickle.dumps(payload)), what)
            self._leave(key, what, data)
            return payload
        self.failure.wait_until(lambda: self.store.check([data]), what)
        value = pickle.loads(self.failure.on_store(lambda: self.store.get(data), what))
        self._leave(key, what, data)
        return value

    def gather(self, payload: Any, what: str) -> list[Any]:
        """Every rank's ``payload`` (pickled), in rank order, on every rank."""
        key = self._next_key(what)
        parts = [f"{key}/data/{rank}" for rank in range(self.world_size)]
        self.failure.on_store(lambda: self.store.set(parts[self.rank], pickle.dumps(payload)), what)
        self.failure.wait_until(lambda: self.store.check(parts), what)
        values = [pickle.loads(self.failure.on_store(lambda part=part: self.store.get(part), what)) for part in parts]
        self._leave(key, what, *parts)
        return values
