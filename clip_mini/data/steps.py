"""Training steps from a dataset: micro-batches from a DataLoader, grouped ``accum_freq`` at a time."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader


def step_batches(dataset, collate: Callable, workers: int, epoch: int, accum_freq: int, **loader_kw: Any
                 ) -> Iterator[list]:
    """Yield lists of ``accum_freq`` micro-batches; an incomplete last step is dropped.

    The loader gets a private generator seeded by ``epoch``: DataLoader draws a base seed per iterator, which must
    not move the global RNG (a resumed epoch creates its iterator at a different point of the stream).
    """
    loader = DataLoader(dataset, collate_fn=collate, num_workers=workers,
                        generator=torch.Generator().manual_seed(epoch), pin_memory=torch.cuda.is_available(),
                        prefetch_factor=4 if workers else None, **loader_kw)
    step = []
    for batch in loader:
        step.append(batch)
        if len(step) == accum_freq:
            yield step
            step = []


class _Batches:
    """A batch sampler whose batches are replaced before each epoch (the persistent loader's index source)."""

    def __init__(self):
        self.batches: list = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class PersistentSteps:
    """``step_batches`` over one DataLoader whose worker processes live for the whole run (``persistent_workers``)
    instead of being started again every epoch (each start re-imports and re-pickles the dataset, per worker).

    The workers hold a copy of the dataset made when they started, so nothing set on it later reaches them: each
    index carries its epoch (``(epoch, row)``), and the dataset (``train.inputs.EpochDataset``) keys its
    augmentation from the index. The batches are the caller's, replaced each epoch.
    """

    def __init__(self, dataset, collate: Callable, workers: int, pin_memory: bool = False):
        self.sampler = _Batches()
        self.loader = DataLoader(dataset, collate_fn=collate, num_workers=workers, batch_sampler=self.sampler,
                                 generator=torch.Generator().manual_seed(0),   # never the global RNG
                                 pin_memory=pin_memory, prefetch_factor=4, persistent_workers=True)

    def steps(self, batches: list, accum_freq: int) -> Iterator[list]:
        """Yield lists of ``accum_freq`` micro-batches of ``batches`` (lists of dataset indices)."""
        self.sampler.batches = batches
        step = []
        for batch in self.loader:
            step.append(batch)
            if len(step) == accum_freq:
                yield step
                step = []
