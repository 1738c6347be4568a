"""The train crop size per epoch: fixed (``--image-size``) or progressive
(``--progressive-resizing``, FFCV's schedule).

FFCV trains ResNet-50 at low resolution for most of the run and ramps up near the end: the early
epochs cost fewer pixels, and the last ones close most of the accuracy gap. Its schedule
(ffcv-imagenet's ``get_resolution``): ``START`` px up to epoch ``FROM_EPOCH``, ``END`` px from
epoch ``TO_EPOCH`` on, linearly interpolated in between and rounded to a multiple of 32. Epochs
count from 0, as FFCV's ``start_ramp`` / ``end_ramp`` do.

Each size is a new input shape: the compiled step specialises to it once (the compile cache
keeps every size) and the graphed step captures a graph for it. The size is a function of the
epoch alone, so a resumed run trains every epoch at the size an uninterrupted one would.

Imports nothing of the package but the config schema, and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config import DataConfig
from fasttrain.errors import UserError

ROUND_TO = 32  # interpolated sizes are multiples of this (FFCV's)
FLAG = "--progressive-resizing"


@dataclass(frozen=True)
class Resolution:
    """The train crop size of each epoch."""

    start: int  # the size up to and including epoch ``from_epoch``
    end: int  # the size from epoch ``to_epoch`` on
    from_epoch: int = 0
    to_epoch: int = 0

    @classmethod
    def fixed(cls, size: int) -> Resolution:
        return cls(size, size)

    @classmethod
    def parse(cls, text: str) -> Resolution:
        """``START:END:FROM_EPOCH:TO_EPOCH``, as ``--progressive-resizing`` takes it."""
        parts = text.split(":")
        try:
            start, end, first, last = (int(p) for p in parts)
        except ValueError:
            raise UserError(
                f"{FLAG} {text}: expected START:END:FROM_EPOCH:TO_EPOCH, four integers, e.g. "
                "160:192:29:34 (160 px up to epoch 29, 192 px from epoch 34)"
            ) from None
        if min(start, end) < ROUND_TO:
            raise UserError(f"{FLAG} {text}: the sizes must be at least {ROUND_TO} px")
        if first < 0 or last < first:
            raise UserError(
                f"{FLAG} {text}: FROM_EPOCH must be at least 0 and TO_EPOCH at least FROM_EPOCH"
            )
        return cls(start, end, first, last)

    @property
    def progressive(self) -> bool:
        return self.start != self.end

    def size_at(self, epoch: int) -> int:
        """The crop size of ``epoch`` (0-based): ffcv-imagenet's ``get_resolution``, with the
        rounded size kept between START and END."""
        if epoch <= self.from_epoch:
            return self.start
        if epoch >= self.to_epoch:
            return self.end
        frac = (epoch - self.from_epoch) / (self.to_epoch - self.from_epoch)
        size = ROUND_TO * round((self.start + frac * (self.end - self.start)) / ROUND_TO)
        return min(max(size, min(self.start, self.end)), max(self.start, self.end))

    @property
    def largest(self) -> int:
        """The largest size of the schedule (it sizes ``--batch-size auto``)."""
        return max(self.start, self.end)

    def describe(self, epochs: int) -> str:
        """One line for the log: which sizes, from which epoch."""
        changes, last = [], None
        for epoch in range(max(epochs, 1)):
            size = self.size_at(epoch)
            if size != last:
                changes.append(f"{size} px from epoch {epoch}")
                last = size
        return ", ".join(changes)


def train_resolution(cfg: DataConfig) -> Resolution:
    """The run's schedule: ``--progressive-resizing`` where given, else ``--image-size``."""
    if cfg.progressive_resizing:
        return Resolution.parse(cfg.progressive_resizing)
    return Resolution.fixed(cfg.image_size)
