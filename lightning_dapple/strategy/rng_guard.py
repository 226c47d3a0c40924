"""Set-up draws nothing from the user's random streams, and every rank starts from rank 0's.

Every rank iterates the same DataLoader (one sampler replica for all), so every rank must
draw the same shuffle, the one plain Lightning would draw in the user's process. Lightning's
DDP set-up re-seeds each rank from ``PL_GLOBAL_SEED`` (``reset_seed``), which discards what
the script drew after ``seed_everything`` (the model's initialisation, typically): the first
epoch's order would then be another than one process's. Here rank 0's streams as the script
left them (rank 0 is the user's process, or under the spawn launcher a copy of its state)
are handed to every rank once the default process group exists
(``share_rank_zero_streams``).

Before the first step the strategy takes a sample batch from the DataLoader (whose shuffling
sampler draws its seed from torch's generator), runs the step up to ``self(...)`` and the
layers (dropout) to profile and check them. Under ``seed_everything`` plain Lightning would
start the first epoch from the seeded state; so must a run with this strategy, or its data
order and dropout masks differ from the run it is compared with.
"""
from __future__ import annotations

import pickle
import random
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["random_states", "random_streams_kept", "set_random_states", "share_rank_zero_streams"]

STREAMS_KEY = "lightning_dapple/random_streams"
_shared_rounds = 0  # set-ups of this process so far: one key per set-up, the same count on every rank


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random


def random_states() -> dict[str, Any]:
    """Python's, NumPy's and torch's generator states (CPU, and the current CUDA device's
    where CUDA is initialised), as ``set_random_states`` takes them."""
    numpy_random = _numpy_random()
    return {
        "python": random.getstate(),
        "numpy": numpy_random.get_state() if numpy_random is not None else None,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def set_random_states(states: dict[str, Any]) -> None:
    """Put ``random_states()`` back (a CUDA state goes to the current device, if CUDA is
    initialised here)."""
    random.setstate(states["python"])
    numpy_random = _numpy_random()
    if numpy_random is not None and states["numpy"] is not None:
        numpy_random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states["cuda"])


def share_rank_zero_streams(store: Any, rank: int, states: dict[str, Any]) -> None:
    """Every rank takes rank 0's ``states`` (taken before the set-up re-seeded anything)
    through the job's store: rank 0 publishes, the others wait for it as long as the
    store's timeout allows."""
    global _shared_rounds
    _shared_rounds += 1
    key = f"{STREAMS_KEY}/{_shared_rounds}"
    if rank == 0:
        store.set(key, pickle.dumps(states))
    set_random_states(states if rank == 0 else pickle.loads(store.get(key)))


@contextmanager
def random_streams_kept() -> Iterator[None]:
    """Put back Python's, NumPy's and torch's (CPU and every initialised CUDA device's)
    generator states when the block ends, whatever it drew."""
    states = random_states()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        set_random_states({**states, "cuda": None})
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
