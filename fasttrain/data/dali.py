"""The fast loader: NVIDIA DALI decodes and augments on the GPU (the hardware JPEG decoder).

Pipelines are written with ``@pipeline_def`` and ``fn.*``. The same definition runs on the GPU
(``device_id`` = local rank, ``mixed`` decoder) and in DALI's CPU mode (``device_id=None``), which
is how CI tests the real pipeline.

- **Train:** reader → ``decoders.image_random_crop`` (area [0.08, 1], aspect [3/4, 4/3]) → resize
  → (``--auto-augment``: DALI's TrivialAugment Wide or RandAugment, through conditional
  execution) → ``crop_mirror_normalize`` with a random flip, fp16 NHWC.
- **Val:** decode → resize the shorter side → center crop → normalise.
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
  ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (``distributed.claim_hardware_queues``, docs/DESIGN.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fasttrain.config.resolution import Resolution
from fasttrain.data.dali_install import require_dali
from fasttrain.data.torchvision import IMAGENET_MEAN, IMAGENET_STD, val_resize
from fasttrain.errors import RuntimeFault
from fasttrain.metrics.profiling import span

READER = "Reader"
# how DALI's file reader names the file it failed on ("File mapping failed: /path/x.jpg")
BAD_FILE = re.compile(r"([^\n:]*failed):\s*(/[^\n]+)")
# decoder scratch sized for ImageNet's largest images (NVIDIA's DeepLearningExamples values), so
# the hardware decoder does not reallocate mid-run
DEVICE_MEMORY_PADDING = 211_025_920
HOST_MEMORY_PADDING = 140_544_512


class DataError(RuntimeFault):
    """DALI stopped on a file it could not decode (a runtime fault, not a bad flag: exit 1)."""


def _pipelines():
    """Build the pipeline functions on first use, so importing fasttrain never needs DALI."""
    from nvidia.dali import fn, pipeline_def, types

    mean = [m * 255 for m in IMAGENET_MEAN]
    std = [s * 255 for s in IMAGENET_STD]

    def decoder_args(gpu: bool, hw_decoder_load: float) -> dict[str, Any]:
        if not gpu:
            return {"device": "cpu"}
        return {
            "device": "mixed",
            "hw_decoder_load": hw_decoder_load,
            "device_memory_padding": DEVICE_MEMORY_PADDING,
            "host_memory_padding": HOST_MEMORY_PADDING,
        }

    def reader(files, labels, shard_id, num_shards, **kw):
        """Explicit file and label lists (labels as ``scan_folder`` numbers them), sharded,
        each shard padded to the same size with its last sample."""
        return fn.readers.file(
            files=files,
            labels=labels,
            shard_id=shard_id,
            num_shards=num_shards,
            pad_last_batch=True,
            name=READER,
            **kw,
        )

    def train_graph(
        files, labels, shard_id, num_shards, image_size, gpu, hw_decoder_load, auto_augment
    ):
        jpegs, label = reader(files, labels, shard_id, num_shards, shuffle_after_epoch=True)
        images = fn.decoders.image_random_crop(
            jpegs,
            output_type=types.RGB,
            random_area=[0.08, 1.0],
            random_aspect_ratio=[3 / 4, 4 / 3],
            num_attempts=100,
            **decoder_args(gpu, hw_decoder_load),
        )
        # antialiased, as torchvision's resize (DALI's default)
        images = fn.resize(images, resize_x=image_size, resize_y=image_size)
        if auto_augment != "none":  # on the crop, as torchvision's reference applies it
            images = _auto_augment(images, auto_augment, image_size)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16,
            output_layout="HWC",
            mean=mean,
            std=std,
            mirror=fn.random.coin_flip(),
        )
        return images, (label.gpu() if gpu else label)

    @pipeline_def(enable_checkpointing=True)
    def val_pipeline(files, labels, shard_id, num_shards, image_size, gpu, hw_decoder_load, resize):
        jpegs, label = reader(files, labels, shard_id, num_shards, stick_to_shard=True)
        images = fn.decoders.image(
            jpegs, output_type=types.RGB, **decoder_args(gpu, hw_decoder_load)
        )
        images = fn.resize(images, resize_shorter=resize)
        images = fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT16,
            output_layout="HWC",
            crop=(image_size, image_size),
            mean=mean,
            std=std,
        )
        return images, (label.gpu() if gpu else label)

    def train_pipeline(*args, auto_augment: str = "none", **kwargs):
        # DALI runs automatic augmentation through conditional execution, which the pipeline
        # must be defined with; without it the graph stays as it was
        conditionals = auto_augment != "none"
        define = pipeline_def(enable_checkpointing=True, enable_conditionals=conditionals)
        return define(train_graph)(*args, auto_augment, **kwargs)

    return train_pipeline, val_pipeline


def _auto_augment(images, policy: str, image_size: int):
    """TrivialAugment Wide or RandAugment (2 ops, magnitude 9: torchvision's defaults) from
    DALI's auto_aug, on uint8 HWC crops of ``image_size``."""
    from nvidia.dali.auto_aug import rand_augment, trivial_augment

    shape = (image_size, image_size)
    if policy == "ta_wide":
        return trivial_augment.trivial_augment_wide(images, shape=shape)
    return rand_augment.rand_augment(images, n=2, m=9, shape=shape)


def shard_bounds(n: int, shard: int, shards: int) -> tuple[int, int]:
    """DALI's file reader gives shard i the samples [floor(n i / s), floor(n (i + 1) / s))."""
    return n * shard // shards, n * (shard + 1) // shards


class DaliLoader:
    """The Loader contract over a DALI pipeline, with fixed output buffers.

    One epoch of the pipeline is ``runs_per_epoch`` batches: the shard, padded to the largest
    shard size by repeating its last sample, in batches. Train yields the first
    ``N // world // batch`` of them (the same count on every rank: fixed shapes, equal steps);
    the rest are run and discarded when the next epoch starts, so the pipeline stays aligned with
    epochs whatever the loop consumed. Val yields every batch, with label -1 on the padding.
    """

    def __init__(
        self,
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
        local_rank: int,
        device: torch.device,
        channels_last: bool,
        buffers: int = 1,
        state: dict[str, Any] | None = None,
        prefetch: int = 4,
        resize: int | None = None,
        auto_augment: str = "none",
        resolution: Resolution | None = None,
        batches: Mapping[int, int] | None = None,
    ):
        """``image_size``: the train crop, or val's center crop. ``buffers``: how many batches
        the caller holds at once (``--accum-steps``); each gets its own fixed buffer, reused
        round-robin. ``state``: from ``state_dict()``, to resume. ``prefetch``: DALI's prefetch
        queue depth. ``resize``: val's shorter side before the crop (default crop / 0.875).
        ``auto_augment``: train only, ``ta_wide`` or ``ra`` (``_auto_augment``), or none.
        ``resolution``: train only, the crop size of each epoch (default: ``image_size``
        throughout); ``batches``: train only, the batch at each crop size where it is not
        ``batch_size``. A new size or batch rebuilds the pipeline from its own checkpoint
        (``_rebuild``)."""
        require_dali()
        if state is not None and len(state["dali"]) != 1:
            state = None  # saved by 0.1.0 with several pipelines: take up the epoch afresh
        self.train = train
        self.device = device
        gpu = device.type == "cuda"
        n = len(samples)
        order = list(range(n))
        if train:  # a seeded global permutation; shuffle_after_epoch reshuffles every epoch
            order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        files = [samples[i][0] for i in order]
        labels = [samples[i][1] for i in order]
        train_pipeline, val_pipeline = _pipelines()
        val_args = () if train else (resize or val_resize(image_size),)
        train_args = {"auto_augment": auto_augment} if train else {}
        pipeline = train_pipeline if train else val_pipeline

        def build(size: int, batch: int, checkpoint: str | None):
            pipe = pipeline(
                files,
                labels,
                rank,
                world,
                size,
                gpu,
                hw_decoder_load,
                *val_args,
                **train_args,
                batch_size=batch,
                num_threads=threads,
                device_id=local_rank if gpu else None,
                seed=seed + 1,  # one seed everywhere: every reader reshuffles alike
                prefetch_queue_depth=prefetch,
                **({"checkpoint": checkpoint} if checkpoint is not None else {}),
            )
            pipe.build()
            return pipe

        self._build = build
        self.n, self.world = n, world
        if not train:
            begin, end = shard_bounds(n, rank, world)
            self.shard_len = end - begin
        # runs into the current epoch (a restored pipeline continues where it was saved)
        self.runs = state["runs"][0] if state else 0
        self.epoch = state["epoch"] if state else 0
        self.start_batch = 0
        self.fresh = state is None  # nothing run yet, nothing restored
        self.resolution = (resolution if train else None) or Resolution.fixed(image_size)
        self.default_batch = batch_size
        self.batches_by_size = dict(batches or {}) if train else {}
        self.size, self.batch_size = self.shape_at(self.epoch)
        self.pipe = build(self.size, self.batch_size, state["dali"][0] if state else None)
        # fixed output buffers per crop size: NHWC storage, handed out as channels_last NCHW
        # views; one set per --accum-steps micro-batch, reused round-robin
        self.n_buffers = buffers
        self.buffers: dict[tuple[int, int], list[tuple[torch.Tensor, ...]]] = {}
        self.channels_last = channels_last
        # every batch lands in the same tensors, unless made contiguous NCHW (a copy)
        self.fixed_buffers = channels_last

    def shape_at(self, epoch: int) -> tuple[int, int]:
        """(crop size, batch) of ``epoch``."""
        size = self.resolution.size_at(epoch)
        return size, self.resolution.batch_at(epoch, self.batches_by_size, self.default_batch)

    def runs_per_epoch(self, batch: int) -> int:
        """The pipeline's batches in an epoch: its reader pads the last one."""
        return math.ceil(math.ceil(self.n / self.world) / batch)

    def batches_in(self, epoch: int) -> int:
        """Batches yielded in ``epoch``: train's are full ones, the same count on every rank
        (fixed shapes, equal steps); val's cover its shard."""
        batch = self.shape_at(epoch)[1]
        return self.n // self.world // batch if self.train else self.runs_per_epoch(batch)

    def __len__(self) -> int:
        return self.batches_in(self.epoch)

    def _run(self):
        """One batch from the pipeline, with DALI's failures on a bad file as one line: its
        decoder does not name the file, its reader does (a zero-byte or unreadable file)."""
        try:
            return self.pipe.run()  # returns once the batch is decoded
        except RuntimeError as e:
            text = str(e)
            split = "train" if self.train else "val"
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
                    f"--loader dali: a {split} image failed to decode, and DALI does not say "
                    f"which; {fix}"
                ) from None
            raise

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

    def close(self) -> None:
        """DALI's pipeline runs threads, not processes; they end with the pipeline."""

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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.start_batch, self.batches_in(self.epoch)):
            images, labels = self._run()
            self.runs += 1
            with span("fasttrain.copy_in"):
                x, y = self._copy_out(images, labels, i % self.n_buffers)
            if not self.train:  # padding past this rank's shard is not a sample
                first_pad = self.shard_len - i * self.batch_size
                if first_pad < self.batch_size:
                    y[max(first_pad, 0) :] = -1
            if not self.channels_last:
                x = x.contiguous()
            yield x, y
        if not self.train:
            self.runs = 0  # val stays on its shard: the next evaluation starts it again
