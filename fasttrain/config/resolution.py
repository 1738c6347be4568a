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

from collections.abc import Mapping
from dataclasses import dataclass

from fasttrain.config.data import DataConfig
from fasttrain.config.schema import Config
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

    def batch_at(self, epoch: int, batches: Mapping[int, int], default: int) -> int:
        """``epoch``'s batch: its size's own in ``batches`` (``--batch-sizes``), else
        ``default``."""
        return batches.get(self.size_at(epoch), default)

    def sizes(self, epochs: int) -> list[int]:
        """The sizes ``epochs`` epochs train at, smallest first."""
        return sorted({self.size_at(e) for e in range(epochs)})

    def describe(self, epochs: int) -> str:
        """One line for the log: which sizes, from which epoch."""
        changes, last = [], None
        for epoch in range(max(epochs, 1)):
            size = self.size_at(epoch)
            if size != last:
                changes.append(f"{size} px from epoch {epoch}")
                last = size
        return ", ".join(changes)


def parse_batch_sizes(text: str | None) -> dict[int, int]:
    """``--batch-sizes``' ``SIZE:BATCH[,SIZE:BATCH...]`` as {size: batch}; {} for None."""
    if not text:
        return {}
    try:
        pairs = [tuple(int(v) for v in part.split(":")) for part in text.split(",")]
        found = {size: batch for size, batch in pairs}
    except ValueError:
        found = {}
    if not found or any(v < 1 for pair in found.items() for v in pair):
        raise UserError(
            f"--batch-sizes {text}: expected SIZE:BATCH pairs of positive integers, comma "
            "separated, e.g. 160:1024,192:704"
        )
    return found


def format_batch_sizes(batches: dict[int, int]) -> str | None:
    """``parse_batch_sizes``' inverse, sizes in order; None for none."""
    return ",".join(f"{s}:{b}" for s, b in sorted(batches.items())) or None


def train_resolution(cfg: DataConfig) -> Resolution:
    """The run's schedule: ``--progressive-resizing`` where given, else ``--image-size``."""
    if cfg.progressive_resizing:
        return Resolution.parse(cfg.progressive_resizing)
    return Resolution.fixed(cfg.image_size)


def resolve_sizes(cfg: Config, notes: list[str]) -> tuple[Resolution, dict[int, int]]:
    """The train sizes' flags, for ``resolve``: --progressive-resizing and --batch-sizes,
    checked and returned parsed (the schedule, and {size: batch})."""
    resolution = _resolve_resolution(cfg, notes)
    return resolution, _resolve_batch_sizes(cfg, resolution)


def _resolve_resolution(cfg: Config, notes: list[str]) -> Resolution:
    """--progressive-resizing: a schedule that parses, in place of --image-size (said if that
    was given too); val's crop defaults to its final size, as it defaults to --image-size."""
    d = cfg.data
    resolution = train_resolution(d)
    if not d.progressive_resizing:
        return resolution
    if d.image_size != DataConfig().image_size:  # given, and unused
        notes.append(
            f"--image-size {d.image_size}: unused for training; --progressive-resizing "
            f"{d.progressive_resizing} sets the train size"
        )
    if d.val_crop_size is None:
        d.val_crop_size = resolution.end
    return resolution


def _resolve_batch_sizes(cfg: Config, resolution: Resolution) -> dict[int, int]:
    """--batch-sizes: pairs that parse, each a size the --progressive-resizing schedule trains
    at, and not beside --batch-size auto (which finds them itself)."""
    t = cfg.train
    batches = parse_batch_sizes(t.batch_sizes)
    if not batches:
        t.batch_sizes = None
        return batches
    flag = f"--batch-sizes {t.batch_sizes}"
    if not cfg.data.progressive_resizing:
        raise UserError(
            f"{flag}: a batch per train size needs --progressive-resizing; with one size, "
            "--batch-size sets the batch"
        )
    if t.batch_size is None:
        raise UserError(
            f"{flag}: --batch-size auto measures each size's batch itself; leave out one of them"
        )
    sizes = resolution.sizes(t.epochs)
    strangers = sorted(set(batches) - set(sizes))
    if strangers:
        raise UserError(
            f"{flag}: {', '.join(map(str, strangers))} px is not a size this run trains at "
            f"(--progressive-resizing {cfg.data.progressive_resizing} over {t.epochs} epochs: "
            f"{', '.join(map(str, sizes))} px)"
        )
    t.batch_sizes = format_batch_sizes(batches)
    return batches
