"""Device placement policies of DAPPLE 4.2 (Fig. 5): Fresh First, Append First, Scatter First.

The planner does not enumerate every set of devices a stage could run on; DAPPLE 4.2
"designed three policies ... and explore[s] their compositions to form the final placement
plan". Each policy answers the pseudo function ``D(gids, n)`` of 4.3: given the ranks already
taken (``state``), return ``n`` more ranks for the next stage, or ``None`` when fewer than
``n`` devices are free.

Our reading of the three policies (the paper gives them in words and one picture):

* **Fresh First** -- take whole fresh machines (no device occupied) first, lowest machine
  first; "it tends to put tasks within a stage onto the same machine, which can leverage
  high-speed NVLink". Only when the fresh machines run out does it spill onto machines that
  are already in use.
* **Append First** -- take the free devices of machines that already have occupied devices
  first ("helps to reduce fragmentation"); we fill the most fragmented machine (fewest free
  devices) first, then move on to fresh machines.
* **Scatter First** -- "use available GPUs equally from all used machines, or use GPUs
  equally from all machines if they are all fresh". When the used machines cannot hold the
  request we spread it over every machine with a free device. Spreading is water-filling:
  each machine gets ``n / k`` devices, capped by what it has free, the remainder going to
  the lowest machines.

All three are deterministic: within a machine the lowest free ranks are taken, and ties
between machines go to the lowest machine index. A machine's ranks are
``[m * devices_per_machine, (m + 1) * devices_per_machine)`` (see ``Cluster``).

Fig. 5 example (3 machines of 8, machine 0 full, ranks 8-11 occupied, request 6): Fresh First
returns 16-21, Append First 12-15 plus 16-17, Scatter First 12-14 plus 16-18.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable, NamedTuple

from lightning_dapple.cluster import Cluster
from lightning_dapple.errors import DappleConfigError, require

__all__ = [
    "PlacementState",
    "fresh_first",
    "append_first",
    "scatter_first",
    "append_near",
    "scatter_all",
    "balance_first",
    "POLICIES",
    "EXTENDED_POLICIES",
    "placement_options",
]


@dataclass(frozen=True)
class PlacementState:
    """Which global ranks of ``cluster`` are already given to earlier stages."""

    cluster: Cluster
    occupied: frozenset[int] = frozenset()

    @classmethod
    def empty(cls, cluster: Cluster) -> "PlacementState":
        return cls(cluster, frozenset())

    @classmethod
    def of(cls, cluster: Cluster, occupied: Iterable[int]) -> "PlacementState":
        ranks = frozenset(int(rank) for rank in occupied)
        require(
            all(0 <= rank < cluster.num_devices for rank in ranks),
            "placement.occupied",
            f"names ranks outside 0..{cluster.num_devices - 1}",
            "give ranks of this cluster",
        )
        return cls(cluster, ranks)

    @property
    def num_free(self) -> int:
        return self.cluster.num_devices - len(self.occupied)

    @cached_property
    def _free_by_machine(self) -> tuple[tuple[int, ...], ...]:
        """Free ranks of every machine, ascending (once per state: the planner asks every
        policy about the same state)."""
        per, occupied = self.cluster.devices_per_machine, self.occupied
        return tuple(tuple(rank for rank in range(m * per, (m + 1) * per) if rank not in occupied) for m in range(self.cluster.machines))

    def free_ranks(self, machine: int) -> tuple[int, ...]:
        return self._free_by_machine[machine]

    @cached_property
    def _machines(self) -> "_Machines":
        """The per-machine facts the policies read (once per state, for every policy and n)."""
        per = self.cluster.devices_per_machine
        counts = tuple([len(ranks) for ranks in self._free_by_machine])
        used = tuple([m for m, free in enumerate(counts) if 0 < free < per])
        return _Machines(
            counts=counts,
            fresh=tuple([m for m, free in enumerate(counts) if free == per]),
            used=used,
            fullest=tuple(sorted(used, key=lambda m: (counts[m], m))),
            open=tuple([m for m, free in enumerate(counts) if free > 0]),
            used_free=sum(counts[m] for m in used),
        )

    def free(self) -> tuple[int, ...]:
        """Every free rank, ascending."""
        return tuple(rank for rank in range(self.cluster.num_devices) if rank not in self.occupied)

    def take(self, ranks: Iterable[int]) -> "PlacementState":
        ranks = tuple(ranks)
        require(not self.occupied.intersection(ranks), "placement", f"ranks {sorted(self.occupied.intersection(ranks))} are taken", "allocate free ranks only")
        return PlacementState(self.cluster, self.occupied.union(ranks))


class _Machines(NamedTuple):
    """Free devices per machine (``counts``); the fresh machines, the used ones (some but not
    all devices taken), those by fewest free devices, every machine with a free device, in
    machine order unless said; and how many devices the used machines have free."""

    counts: tuple[int, ...]
    fresh: tuple[int, ...]
    used: tuple[int, ...]
    fullest: tuple[int, ...]
    open: tuple[int, ...]
    used_free: int


def _allocate_in_order(state: PlacementState, machines: Iterable[int], n: int) -> tuple[int, ...] | None:
    chosen: list[int] = []
    free = state._free_by_machine
    for machine in machines:
        chosen.extend(free[machine][: n - len(chosen)])
        if len(chosen) == n:
            return tuple(sorted(chosen))
    return None


def _check_request(state: PlacementState, n: int) -> bool:
    if not (isinstance(n, int) and n >= 1):  # checked first: the message is built only when needed
        raise DappleConfigError("placement.n", f"must be a positive integer, got {n!r}", "ask for at least one device")
    return n <= state.num_free


def fresh_first(state: PlacementState, n: int) -> tuple[int, ...] | None:
    """Fresh First (DAPPLE 4.2): fresh machines first, lowest machine and rank first."""
    if not _check_request(state, n):
        return None
    machines = state._machines
    return _allocate_in_order(state, machines.fresh + machines.used, n)


def append_first(state: PlacementState, n: int) -> tuple[int, ...] | None:
    """Append First (DAPPLE 4.2): fill machines already in use (fewest free first), then fresh ones."""
    if not _check_request(state, n):
        return None
    machines = state._machines
    return _allocate_in_order(state, machines.fullest + machines.fresh, n)


def _water_fill(capacity: list[int], n: int) -> list[int]:
    """Split ``n`` over machines as evenly as their free ``capacity`` allows (lowest first on ties).

    Every round either places all that is left or closes at least one full machine, so it ends.
    """
    share = [0] * len(capacity)
    left = n
    open_ = [i for i, cap in enumerate(capacity) if cap > 0]
    while left > 0 and open_:
        each, extra = divmod(left, len(open_))
        still_open = []
        for position, i in enumerate(open_):
            want = each + (1 if position < extra else 0)
            give = min(want, capacity[i] - share[i])
            share[i] += give
            left -= give
            if share[i] < capacity[i]:
                still_open.append(i)
        open_ = still_open
    return share


def scatter_first(state: PlacementState, n: int) -> tuple[int, ...] | None:
    """Scatter First (DAPPLE 4.2): spread evenly over the used machines, else over all with room."""
    if not _check_request(state, n):
        return None
    machines = state._machines
    counts = machines.counts
    pool = machines.used if machines.used_free >= n else machines.open
    shares = _water_fill([counts[m] for m in pool], n)
    chosen: list[int] = []
    for machine, share in zip(pool, shares):
        chosen.extend(state.free_ranks(machine)[:share])
    return tuple(sorted(chosen)) if len(chosen) == n else None


def append_near(state: PlacementState, n: int, near: Iterable[int] = ()) -> tuple[int, ...] | None:
    """Append First, preferring the machines of ``near`` (the previous stage's ranks).

    An extension of ours: keeping consecutive stages on the same machines sends their
    activations over NVLink instead of the network. Machines of ``near`` are tried first (in
    machine order), then the rest as in Append First.
    """
    if not _check_request(state, n):
        return None
    per = state.cluster.devices_per_machine
    machines = state._machines
    home = sorted({rank // per for rank in near})
    others = [m for m in machines.fullest if m not in home]
    fresh = [m for m in machines.fresh if m not in home]
    return _allocate_in_order(state, [*home, *others, *fresh], n)


def scatter_all(state: PlacementState, n: int) -> tuple[int, ...] | None:
    """Scatter over every machine with a free device, used or fresh (an extension of ours)."""
    if not _check_request(state, n):
        return None
    counts = state._machines.counts
    pool = state._machines.open
    shares = _water_fill([counts[m] for m in pool], n)
    chosen: list[int] = []
    for machine, share in zip(pool, shares):
        chosen.extend(state.free_ranks(machine)[:share])
    return tuple(sorted(chosen)) if len(chosen) == n else None


def balance_first(state: PlacementState, n: int) -> tuple[int, ...] | None:
    """Take each device from the machine with the most free devices (an extension of ours).

    Leaves the free devices as evenly spread as possible: DAPPLE 4.2 notes that scattering
    "could also serve as an intermediate state to allocate GPU with minimal fragmentation".
    """
    if not _check_request(state, n):
        return None
    counts = state._machines.counts
    take = [0] * len(counts)
    for _ in range(n):
        machine = max(range(len(counts)), key=lambda m: (counts[m] - take[m], -m))
        take[machine] += 1
    chosen: list[int] = []
    for machine, share in enumerate(take):
        chosen.extend(state.free_ranks(machine)[:share])
    return tuple(sorted(chosen))


Policy = Callable[[PlacementState, int], "tuple[int, ...] | None"]

POLICIES: dict[str, Policy] = {
    "fresh_first": fresh_first,
    "append_first": append_first,
    "scatter_first": scatter_first,
}

EXTENDED_POLICIES: dict[str, Policy] = {
    "scatter_all": scatter_all,
    "balance_first": balance_first,
}


def placement_options(
    state: PlacementState,
    n: int,
    near: Iterable[int] | None = None,
    extended: bool = True,
) -> list[tuple[str, tuple[int, ...]]]:
    """The distinct rank sets offered for ``n`` devices, the paper's three policies first.

    Given the previous stage's ranks ``near``, ``append_near`` is offered too; with
    ``extended`` (the planner's default up to 16 devices) also ``scatter_all`` and
    ``balance_first``. They cost a few more DP transitions and close most of the gap to an
    exhaustive search over all placements (tests/test_planner_optimality.py).
    """
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[str, tuple[int, ...]]] = []

    def offer(name: str, ranks: tuple[int, ...] | None) -> None:
        if ranks is not None and ranks not in seen:
            seen.add(ranks)
            out.append((name, ranks))

    for name, policy in POLICIES.items():
        offer(name, policy(state, n))
    if near:
        offer("append_near", append_near(state, n, near))
    if extended:
        for name, policy in EXTENDED_POLICIES.items():
            offer(name, policy(state, n))
    return out
