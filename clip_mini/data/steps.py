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
