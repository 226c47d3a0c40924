"""Set-up draws nothing from the user's random streams.

Before the first step the strategy takes a sample batch from the DataLoader (whose shuffling
sampler draws its seed from torch's generator), runs the step up to ``self(...)`` and the
layers (dropout) to profile and check them. Under ``seed_everything`` plain Lightning would
start the first epoch from the seeded state; so must a run with this strategy, or its data
order and dropout masks differ from the run it is compared with.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import torch

__all__ = ["random_streams_kept"]


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy.random


@contextmanager
def random_streams_kept() -> Iterator[None]:
    """Put back Python's, NumPy's and torch's (CPU and every initialised CUDA device's)
    generator states when the block ends, whatever it drew."""
    numpy_random = _numpy_random()
    python_state = random.getstate()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
