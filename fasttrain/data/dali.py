"""The fast loader: NVIDIA DALI decodes and augments on the GPU (the hardware JPEG decoder).

The pipelines are ``dali_pipelines.py``'s; the same definition runs on the GPU (``device_id`` =
local rank, ``mixed`` decoder) and in DALI's CPU mode (``device_id=None``), which is how CI tests
the real pipeline. ``DaliTrainLoader`` and ``DaliValLoader`` share the pipeline's running and
the output buffers (``_DaliLoader``); ``build_dali_loader`` picks one, as
``build_torchvision_loader`` does.

- **Output:** each batch is copied (``feed_ndarray``) into fixed buffers allocated once, handed out
  as a channels_last NCHW *view* of the NHWC buffer: no layout copy, no allocation per step, and
  the same addresses every step, which a CUDA-graphed step reads directly. The images stay fp16
  (DALI has no bf16 output); the step casts them to its compute dtype inside its own kernels.
- **Shuffling:** the reader gets the file list pre-permuted with the seed and
  ``shuffle_after_epoch=True``, a fresh global permutation every epoch, identical on every rank so
  the shards stay disjoint. DALI's ``random_shuffle`` only shuffles within a 1,024-sample buffer,
  which over a class-sorted list such as ImageNet's would fill batches with one or two classes.
- **Sharding:** ``shard_id`` = global rank, ``num_shards`` = world size, ``device_id`` = local
  rank. Every rank trains on the same number of full batches (``N // world // batch``).
- **Resume:** the reader and RNG state come from DALI's own checkpoint (``enable_checkpointing``),
  saved with fasttrain's.
- **Beside a CUDA graph** DALI needs its own hardware queues: fasttrain sets
  ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (``dist.state.claim_hardware_queues``, docs/DESIGN.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fasttrain.config.resolution import Resolution
from fasttrain.data.dali_install import require_dali
from fasttrain.data.dali_pipelines import BAD_FILE, pipelines
from fasttrain.data.loader import CopyClock
from fasttrain.data.torchvision import val_resize
from fasttrain.errors import RuntimeFault


class DataError(RuntimeFault):
    """DALI stopped on a file it could not decode (a runtime fault, not a bad flag: exit 1)."""


@dataclass(frozen=True)
class DaliPlace:
    """Where and how a pipeline runs: its threads and decoder, the shard it reads, the device
    its batches land on."""

    threads: int
    hw_decoder_load: float
    prefetch: int  # DALI's prefetch queue depth
    seed: int
    rank: int
    world: int
    device: torch.device  # the GPU by its index in this process (dist/devices.py)
    channels_last: bool

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


def shard_bounds(n: int, shard: int, shards: int) -> tuple[int, int]:
    """DALI's file reader gives shard i the samples [floor(n i / s), floor(n (i + 1) / s))."""
    return n * shard // shards, n * (shard + 1) // shards


class _DaliLoader:
    """What both loaders share: the pipeline's build and runs (a bad file as one line), and the
    fixed output buffers, one set per crop size and batch."""

    split = ""  # "train" or "val", for messages

    def __init__(
        self,
        files: list[str],
        labels: list[int],
        place: DaliPlace,
        define: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
        buffers: int,
    ):
        """``define(files, labels, shard, shards, size, gpu, hw_decoder_load, *args, **kwargs)``
        is the pipeline; ``buffers``: how many batches the caller holds at once, each with its
        own fixed buffer, reused round-robin."""
        require_dali()
        self.place = place
        self.device = place.device
        self.n = len(files)
        self._define = (define, files, labels, args, kwargs)
        self.n_buffers = buffers
        self.buffers: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}
        self.channels_last = place.channels_last
        # every batch lands in the same tensors, unless made contiguous NCHW (a copy)
        self.fixed_buffers = place.channels_last
        self.copy_clock = CopyClock()
        self.runs = 0  # the pipeline's batches run in the current epoch
        self.scheduled = False  # the pipeline's next batch is scheduled (by its build)

    def _build(self, size: int, batch: int, checkpoint: str | None = None, schedule: bool = True):
        """A built pipeline cropping at ``size`` in batches of ``batch``, restored from
        ``checkpoint`` where given; ``schedule``: its first batches start now (``_run`` takes
        them)."""
        define, files, labels, args, kwargs = self._define
        p = self.place
        pipe = define(
            files,
            labels,
            p.rank,
            p.world,
            size,
            p.gpu,
            p.hw_decoder_load,
            *args,
            **kwargs,
            batch_size=batch,
            num_threads=p.threads,
            device_id=(p.device.index or 0) if p.gpu else None,
            seed=p.seed + 1,  # one seed everywhere: every reader reshuffles alike
            prefetch_queue_depth=p.prefetch,
            **({"checkpoint": checkpoint} if checkpoint is not None else {}),
        )
        pipe.build()
        # its first batches (prefetch_queue_depth of them) start on DALI's own threads now,
        # while the model is built and compiled, not when the first step asks for one
        if schedule:
            self._named_failures(pipe.schedule_run)
            self.scheduled = True
        return pipe

    def runs_per_epoch(self, batch: int) -> int:
        """The pipeline's batches in an epoch: its reader pads the last one."""
        return math.ceil(math.ceil(self.n / self.place.world) / batch)

    def _run(self):
        """One batch from the pipeline: ``pipe.run()``, where the build scheduled the first."""
        if not self.scheduled:
            self._named_failures(self.pipe.schedule_run)
        self.scheduled = False
        return self._named_failures(self.pipe.outputs)  # returns once the batch is decoded

    def _named_failures(self, call: Callable[[], Any]) -> Any:
        """``call()``, with DALI's failures on a bad file as one line: its decoder does not name
        the file, its reader does (a zero-byte or unreadable file)."""
        try:
            return call()
        except RuntimeError as e:
            text = str(e)
            fix = (
                "run `python -m fasttrain check-data DIR` once (training then leaves the bad "
                "files out), or use --loader torchvision, which skips them"
            )
            if "readers.file" in text:
                named = BAD_FILE.search(text)
                what = f"{named.group(2)} ({named.group(1)})" if named else "a file"
                raise DataError(f"--loader dali: DALI cannot read {what}; {fix}") from None
            if "decoders" in text:
                raise DataError(
                    f"--loader dali: a {self.split} image failed to decode, and DALI does not "
                    f"say which; {fix}"
                ) from None
            raise

    def _copy_out(self, images, labels, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one batch into buffer ``slot``; returns (NCHW view of the images, labels)."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        key = (self.size, self.batch_size)
        if key not in self.buffers:
            shape = (self.batch_size, self.size, self.size, 3)
            self.buffers[key] = [
                (
                    torch.empty(shape, dtype=torch.float16, device=self.device),
                    torch.empty((self.batch_size, 1), dtype=torch.int32, device=self.device),
                    torch.empty((self.batch_size,), dtype=torch.int64, device=self.device),
                )
                for _ in range(self.n_buffers)
            ]
        images_nhwc, labels_i32, labels_i64 = self.buffers[key][slot]
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        feed_ndarray(images.as_tensor(), images_nhwc, cuda_stream=stream)
        feed_ndarray(labels.as_tensor(), labels_i32, cuda_stream=stream)
        labels_i64.copy_(labels_i32.view(-1))  # int64 on the device, as the loss wants
        return images_nhwc.permute(0, 3, 1, 2), labels_i64  # a channels_last view: no copy

    def _batch(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's next batch, in buffer ``slot``."""
        images, labels = self._run()
        self.runs += 1
        with self.copy_clock.timing():
            return self._copy_out(images, labels, slot)

    def _output(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x if self.channels_last else x.contiguous()), y

    def close(self) -> None:
        """DALI's pipeline runs threads, not processes; they end with the pipeline."""


class DaliTrainLoader(_DaliLoader):
    """The Loader contract over DALI's train pipeline, with fixed output buffers.

    One epoch of the pipeline is ``runs_per_epoch`` batches: the shard, padded to the largest
    shard size by repeating its last sample, in batches. It yields the first
    ``N // world // batch`` of them (the same count on every rank: fixed shapes, equal steps);
    the rest are run and discarded when the next epoch starts, so the pipeline stays aligned with
    epochs whatever the loop consumed. A new crop size or batch rebuilds the pipeline from its
    own checkpoint (``_rebuild``).
    """

    split = "train"

    def __init__(
        self,
        samples: list[tuple[str, int]],
        place: DaliPlace,
        *,
        image_size: int,
        batch_size: int,
        buffers: int = 1,
        state: dict[str, Any] | None = None,
        auto_augment: str = "none",
        resolution: Resolution | None = None,
        batches: Mapping[int, int] | None = None,
    ):
        """``image_size``: the crop (``resolution``, the crop of each epoch, where given);
        ``batches``: the batch at each crop size where it is not ``batch_size``. ``buffers``:
        ``--accum-steps``. ``state``: from ``state_dict()``, to resume. ``auto_augment``:
        ``ta_wide`` or ``ra`` (``dali_pipelines``), or none."""
        if state is not None and len(state["dali"]) != 1:
            state = None  # saved by 0.1.0 with several pipelines: take up the epoch afresh
        # a seeded global permutation; shuffle_after_epoch reshuffles every epoch
        order = torch.randperm(
            len(samples), generator=torch.Generator().manual_seed(place.seed)
        ).tolist()
        train_pipeline, _ = pipelines()
        super().__init__(
            [samples[i][0] for i in order],
            [samples[i][1] for i in order],
            place,
            train_pipeline,
            (),
            {"auto_augment": auto_augment},
            buffers,
        )
        # runs into the current epoch (a restored pipeline continues where it was saved)
        self.runs = state["runs"][0] if state else 0
        self.epoch = state["epoch"] if state else 0
        self.start_batch = 0
        self.fresh = state is None  # nothing run yet, nothing restored
        self.resolution = resolution or Resolution.fixed(image_size)
        self.default_batch = batch_size
        self.batches_by_size = dict(batches or {})
        self.size, self.batch_size = self.shape_at(self.epoch)
        self.pipe = self._build(self.size, self.batch_size, state["dali"][0] if state else None)

    def shape_at(self, epoch: int) -> tuple[int, int]:
        """(crop size, batch) of ``epoch``."""
        size = self.resolution.size_at(epoch)
        return size, self.resolution.batch_at(epoch, self.batches_by_size, self.default_batch)

    def batches_in(self, epoch: int) -> int:
        """Full batches, the same count on every rank (fixed shapes, equal steps)."""
        return self.n // self.place.world // self.shape_at(epoch)[1]

    def __len__(self) -> int:
        return self.batches_in(self.epoch)

    def _skip(self, until: int) -> None:
        while self.runs < until:
            self._run()
            self.runs += 1

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Start ``epoch``; a resumed run's pipeline (restored from its checkpoint) is already at
        ``start_batch``. The previous epoch's unused runs are drained first."""
        if self.fresh and (epoch, start_batch) != (0, 0):
            # resumed without a reader state (saved at another world size): take up the epoch
            # with this order, and run past the batches already trained on
            self.epoch = epoch
            self._take_shape()
            self._skip(start_batch)
        self.fresh = False
        while self.epoch < epoch:  # drain this epoch, then move to the next one's shape
            self._skip(self.runs_per_epoch(self.batch_size))
            self.runs = 0
            self.epoch += 1
            self._take_shape()
        if self.runs != start_batch:
            raise RuntimeError(
                f"the DALI pipeline is at batch {self.runs} of epoch {epoch}, asked for "
                f"batch {start_batch}"
            )
        self.start_batch = start_batch

    def _take_shape(self) -> None:
        """Rebuild the pipeline if the current epoch crops at another size or batch."""
        if self.shape_at(self.epoch) != (self.size, self.batch_size):
            self._rebuild(*self.shape_at(self.epoch))

    def _rebuild(self, size: int, batch: int) -> None:
        """Crop at ``size``, in batches of ``batch``, from here on (an epoch's start). Both are
        fixed in a DALI graph, so a new pipeline is built and restored from the old one's
        checkpoint: the reader's position and its shuffling carry over. At the same batch every
        random draw does too (the samples and their crop windows are the ones the old pipeline
        would have produced, at the new size); at another batch the samples are the same, in
        the same order, and the augmentation's draws are new ones."""
        checkpoint = self.pipe.checkpoint()
        self.pipe = None  # its buffers go before the new pipeline allocates its own
        self.pipe = self._build(size, batch, checkpoint)
        self.size, self.batch_size = size, batch

    def state_dict(self) -> dict[str, Any]:
        """The pipeline's own checkpoint (reader position, RNG) and where it is in the epoch.
        Lists of one pipeline's, the form 0.1.0 wrote, so its checkpoints still resume."""
        return {"dali": [self.pipe.checkpoint()], "epoch": self.epoch, "runs": [self.runs]}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.start_batch, self.batches_in(self.epoch)):
            yield self._output(*self._batch(i % self.n_buffers))


class DaliValLoader(_DaliLoader):
    """The Loader contract over DALI's val pipeline: each rank reads its own shard
    (``stick_to_shard``) in batches covering it, every image once; the reader's padding of the
    last batch is labelled -1, which the evaluator leaves out."""

    split = "val"

    def __init__(
        self,
        samples: list[tuple[str, int]],
        place: DaliPlace,
        *,
        image_size: int,
        batch_size: int,
        resize: int | None = None,
    ):
        """``image_size``: the center crop; ``resize``: the shorter side before it (default
        ``val_resize(image_size)``, crop / 0.875)."""
        _, val_pipeline = pipelines()
        super().__init__(
            [path for path, _ in samples],
            [label for _, label in samples],
            place,
            val_pipeline,
            (resize or val_resize(image_size),),
            {},
            1,
        )
        begin, end = shard_bounds(self.n, place.rank, place.world)
        self.shard_len = end - begin
        self.size, self.batch_size = image_size, batch_size
        # built at the first evaluation: not on the way to the first step, nor at all with
        # --eval-every 0 (its buffers stay free)
        self.pipe = None

    def batches_in(self, epoch: int) -> int:
        """Batches covering this rank's shard, the last padded."""
        return self.runs_per_epoch(self.batch_size)

    def __len__(self) -> int:
        return self.batches_in(0)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Val reads its whole shard every time: nothing to move to."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.pipe is None:
            self.pipe = self._build(self.size, self.batch_size)
        for i in range(self.batches_in(0)):
            x, y = self._batch(0)
            first_pad = self.shard_len - i * self.batch_size  # past this rank's shard
            if first_pad < self.batch_size:
                y[max(first_pad, 0) :] = -1
            yield self._output(x, y)
        self.runs = 0  # val stays on its shard: the next evaluation starts it again


def build_dali_loader(
    samples: list[tuple[str, int]],
    *,
    train: bool,
    image_size: int,
    batch_size: int,
    threads: int,
    hw_decoder_load: float,
    seed: int,
    rank: int,
    world: int,
    device: torch.device,
    channels_last: bool,
    prefetch: int = 4,
    **split: Any,
) -> DaliTrainLoader | DaliValLoader:
    """The train or val loader over ``samples``; ``split`` holds what only one of them takes
    (``DaliTrainLoader``'s ``buffers``, ``state``, ``auto_augment``, ``resolution``,
    ``batches``; ``DaliValLoader``'s ``resize``)."""
    place = DaliPlace(threads, hw_decoder_load, prefetch, seed, rank, world, device, channels_last)
    loader = DaliTrainLoader if train else DaliValLoader
    return loader(samples, place, image_size=image_size, batch_size=batch_size, **split)
