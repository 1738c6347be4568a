"""One loader contract for every backend (``Loader``), and what building a run's data returns.

A loader yields fixed-shape ``(images, labels)`` already on the device: images channels_last
(unless turned off) in a float dtype (the compute dtype, or DALI's fp16, which the step casts),
labels int64.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from fasttrain.metrics.profiling import span


class CopyClock:
    """The host's seconds copying batches to the device (and normalising them there): the part
    of the host's wait for data that is not the loader's. The train loop reads it before and
    after each fetch, so the two can be told apart without a profiler."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        """A copy-in: timed here, and a ``fasttrain.copy_in`` range in a ``--profile`` trace."""
        t0 = time.perf_counter()
        try:
            with span("fasttrain.copy_in"):
                yield
        finally:
            self.seconds += time.perf_counter() - t0


class Loader(Protocol):
    """What the trainer, the step and the evaluator need of a loader."""

    # Every batch lands in the same tensors: a CUDA-graphed step reads them in place instead of
    # copying each batch into buffers of its own.
    fixed_buffers: bool
    # The host's time copying batches to the device so far (zero where they are made there).
    copy_clock: CopyClock

    def __len__(self) -> int:
        """Batches in a whole epoch (the first), whatever the resume position."""

    def batches_in(self, epoch: int) -> int:
        """Batches in the whole of ``epoch``: each train size may have its own batch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start ``epoch``, skipping the ``start_batch`` batches a resumed run trained on."""

    def state_dict(self) -> dict:
        """What the loader itself must carry across a resume: empty where the position follows
        from the step, DALI's reader state otherwise."""

    def close(self) -> None:
        """Release worker processes now: the trainer owns their lifetime, so that no exit waits
        on them."""


@dataclass
class Data:
    train: Loader
    val: Loader | None  # None for synthetic data: there is nothing to evaluate
    num_classes: int
    description: str

    def close(self) -> None:
        """Release both loaders' workers (``Loader.close``)."""
        for loader in (self.train, self.val):
            if loader is not None:
                loader.close()
