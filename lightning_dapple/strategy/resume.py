"""A DataLoader that resumes where a checkpoint left it, so a resumed run sees the batches
an uninterrupted run would have seen.

Lightning restores a loader's position only if the loader is stateful (``state_dict`` /
``load_state_dict``); a plain DataLoader restarts its epoch from the first batch when a
run resumes from a checkpoint written mid-epoch, so the resumed run trains on other data
than the run it continues. ``ResumableDataLoader`` records how many batches of the current
epoch training has taken, and after ``load_state_dict`` skips them -- by sampler indices,
without loading them. Shuffling draws each epoch's order from ``(seed, epoch)`` (Lightning
calls ``set_epoch`` at every epoch start), so the order after a resume is the order the
uninterrupted run had. Every dapple rank iterates the same global batches
(``DappleStrategy.distributed_sampler_kwargs``), so the state is the same on every rank.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from lightning_dapple.errors import require


class EpochSampler(Sampler[int]):
    """Indices ``0..n-1``, shuffled by ``(seed, epoch)`` if asked, from an offset."""

    def __init__(self, length: int, shuffle: bool, seed: int) -> None:
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.offset = 0  # samples to skip at the next iteration only

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        offset, self.offset = self.offset, 0
        return iter(self.order()[offset:])

    def __len__(self) -> int:
        return self.length


class ResumableDataLoader(DataLoader):
    """``DataLoader(dataset, batch_size, shuffle, seed=...)`` whose position is part of the
    checkpoint. Map-style datasets with a fixed ``batch_size`` only (the skip is counted in
    samples)."""

    def __init__(self, dataset: Any, batch_size: int, shuffle: bool = False, seed: int = 0, **kwargs: Any) -> None:
        require(
            isinstance(batch_size, int) and batch_size > 0,
            "ResumableDataLoader(batch_size)",
            f"is {batch_size!r}",
            "give a positive batch size (the skip after a resume is counted in samples)",
        )
        for key in ("sampler", "batch_sampler"):
            require(key not in kwargs, f"ResumableDataLoader({key})", "is given", "leave it out: the loader builds its own sampler")
        super().__init__(dataset, batch_size=batch_size, sampler=EpochSampler(len(dataset), shuffle, seed), **kwargs)
        self._yielded = 0
        self._resume_epoch: int | None = None

    @property
    def _epoch_sampler(self) -> EpochSampler:
        sampler = self.sampler
        assert isinstance(sampler, EpochSampler)
        return sampler

    def __iter__(self) -> Iterator[Any]:
        sampler = self._epoch_sampler
        skip = 0
        if self._resume_epoch is not None and self._resume_epoch == sampler.epoch:
            skip = self._yielded
            sampler.offset = skip * self.batch_size  # type: ignore[operator]
        self._resume_epoch = None
        return self._counted(super().__iter__(), skip)

    def _counted(self, batches: Iterator[Any], start: int) -> Iterator[Any]:
        self._yielded = start
        for batch in batches:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches of it that training has taken. Lightning fetches ahead
        only from loaders without a length (loops/fetchers.py), and this one has one, so
        every batch handed out was taken by a step when a checkpoint is written."""
        return {"epoch": self._epoch_sampler.epoch, "consumed": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip the consumed batches at the next iteration of the same epoch."""
        self._epoch_sampler.set_epoch(int(state["epoch"]))
        self._resume_epoch = int(state["epoch"])
        self._yielded = int(state["consumed"])
