"""The reference loader: ImageFolder-style decode on CPU workers, uint8 to the GPU, normalise there.

uint8 crosses the bus (4x fewer bytes than float32) from pinned memory with non-blocking copies;
the float conversion and normalisation run on the device. Augmentation is keyed on
(seed, epoch, sample index) rather than on worker RNG state, so the images a step sees do not depend
on the worker count, and a resumed run sees exactly what an uninterrupted one would.
"""

from __future__ import annotations

import logging
import math
import random
import signal
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from fasttrain.config.resolution import Resolution
from fasttrain.data.loader import CopyClock

log = logging.getLogger("fasttrain")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_SUBSTITUTE_STRIDE = 7919  # a prime: a bad train image is replaced by one far from it


def _auto_augment(policy: str):
    """torchvision's TrivialAugment Wide or RandAugment (2 ops, magnitude 9), bilinear as in
    its reference recipe; None for ``none``."""
    from torchvision.transforms import InterpolationMode, v2

    if policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR)
    if policy == "ra":
        return v2.RandAugment(interpolation=InterpolationMode.BILINEAR)
    return None


def val_resize(crop: int) -> int:
    """The shorter side val images are resized to before a ``crop`` center crop: crop / 0.875,
    the ImageNet references' ratio (224 -> 256)."""
    return round(crop / 0.875)


def random_resized_crop_params(
    rng: random.Random, width: int, height: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, drawing from ``rng``, not torch's global RNG."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: central crop
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB from any PIL mode: grayscale, CMYK and palette through PIL; 16-bit grayscale scaled
    to 8 bits (PIL's own conversion clips it to 255)."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        wide = np.asarray(im, dtype=np.uint32 if im.mode == "I" else np.uint16)
        top = 65535 if im.mode != "I" else max(int(wide.max()), 1)
        return Image.fromarray((wide.astype(np.float32) * (255 / top)).astype(np.uint8)).convert(
            "RGB"
        )
    return im.convert("RGB")


class ImageFolderDataset(Dataset):
    """Indexed by ``(index, epoch)`` pairs from the samplers below; returns uint8 CHW tensors.

    A file that fails to decode never crashes the run and never shifts a label: in training it is
    replaced by another sample (with that sample's own label); in validation it comes back with
    label -1 and is left out of the counts. Either way its path is returned so the main process can
    count it and warn.
    """

    def __init__(
        self,
        samples: list[tuple[str, int]],
        train: bool,
        image_size: int,
        seed: int,
        resize: int | None = None,
        auto_augment: str = "none",
        resolution: Resolution | None = None,
    ):
        """``resolution``: train only, the crop size of each epoch (default: ``image_size``
        throughout); the epoch comes with each index, so workers need no message to change."""
        self.samples = samples
        self.train = train
        self.augment = _auto_augment(auto_augment) if train else None
        self.image_size = image_size
        self.resolution = resolution or Resolution.fixed(image_size)
        # val: the shorter side before the center crop; 224 -> 256, as in the ImageNet references
        self.resize = resize or val_resize(image_size)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, index: int, epoch: int) -> torch.Tensor:
        path, _ = self.samples[index]
        with warnings.catch_warnings():  # a 10k x 10k photo is big, not a decompression bomb
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                # as a viewer shows it, and as DALI's decoder hands it over: EXIF orientation
                img = to_rgb(ImageOps.exif_transpose(im))
        if self.train:
            rng = random.Random(f"{self.seed}-{epoch}-{index}")
            top, left, h, w = random_resized_crop_params(rng, img.width, img.height)
            size = self.resolution.size_at(epoch)
            img = F.resized_crop(img, top, left, h, w, [size, size], antialias=True)
            if rng.random() < 0.5:
                img = F.hflip(img)
            if self.augment is not None:  # its draws seeded per sample too: resumable
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(rng.getrandbits(63))
                    img = self.augment(img)
        else:
            img = F.center_crop(F.resize(img, self.resize, antialias=True), self.image_size)
        # HWC: batches collate to NHWC, which is channels_last NCHW seen through a permute
        return F.pil_to_tensor(img).permute(1, 2, 0).contiguous()

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int, str]:
        index, epoch = key
        bad: list[str] = []
        for attempt in range(len(self.samples)):
            i = (index + attempt * _SUBSTITUTE_STRIDE) % len(self.samples)
            try:
                return self._load(i, epoch), self.samples[i][1], ";".join(bad)
            except Exception:  # any decode failure: PIL raises many types
                bad.append(self.samples[i][0])
                if not self.train:
                    size = self.image_size
                    return torch.zeros(size, size, 3, dtype=torch.uint8), -1, ";".join(bad)
        raise RuntimeError("no image in the dataset could be decoded")


class TrainSampler(DistributedSampler):
    """DistributedSampler (shuffled, drop_last) yielding batches of ``(index, epoch)``, each
    epoch at its own batch size (``batch_at``), and able to start mid-epoch: a DataLoader's
    ``batch_sampler``.

    Each rank gets an equal share; the last partial batch is dropped, so every step of an epoch
    has the same shape. ``start_batch`` skips the batches a resumed run has already trained on.
    """

    def __init__(self, n: int, rank: int, world: int, seed: int, batch_at: Callable[[int], int]):
        super().__init__(
            range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batch_at = batch_at
        self.start_batch = 0

    def set_position(self, epoch: int, start_batch: int) -> None:
        self.set_epoch(epoch)
        self.start_batch = start_batch

    def full_batches(self, epoch: int) -> int:
        return self.num_samples // self.batch_at(epoch)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        indices = list(super().__iter__())
        b = self.batch_at(self.epoch)
        for k in range(self.start_batch, self.full_batches(self.epoch)):
            yield [(i, self.epoch) for i in indices[k * b : (k + 1) * b]]

    def __len__(self) -> int:
        return self.full_batches(self.epoch) - self.start_batch


class ValSampler(Sampler):
    """Every val image exactly once across ranks: rank r takes r, r + world, ... (no padding)."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = list(range(rank, n, world))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((i, 0) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class DeviceLoader:
    """Wraps a DataLoader: moves uint8 batches to the device and normalises them there.

    Yields ``(images, labels)`` on ``device``: images channels_last in ``dtype``, labels int64.
    Counts undecodable files and warns once per file.
    """

    fixed_buffers = False  # each batch is a new tensor: a graphed step copies it into its own

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        sampler: TrainSampler | ValSampler,
        triton_normalize: bool = False,
    ):
        """``triton_normalize``: normalise with fasttrain's Triton kernel (kernels/normalize.py)
        instead of the torch ops."""
        self.loader = loader
        self.triton_normalize = triton_normalize
        if triton_normalize:
            from fasttrain.kernels.normalize import normalize

            self.normalize = normalize
        self.sampler = sampler
        self.device = device
        self.dtype = dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
        self.inv_std = 1 / (torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255)
        self.copy_clock = CopyClock()
        self.bad_files: set[str] = set()
        self.labels: dict[str, int] | None = None  # path -> label, once a file has failed
        self.class_sizes: Counter = Counter()

    def batches_in(self, epoch: int) -> int:
        """Batches in a whole epoch (train) or in the val set, whatever the resume position."""
        s = self.sampler
        if isinstance(s, TrainSampler):
            return s.full_batches(epoch)
        return math.ceil(len(s) / self.loader.batch_size)

    def __len__(self) -> int:
        return self.batches_in(0)

    def _whole_class(self, path: str) -> None:
        """Name a class once every one of its images has failed: per-file warnings alone would
        hide that the model never sees it."""
        samples = self.loader.dataset.samples
        if self.labels is None:  # built on the first bad file only: most datasets have none
            self.labels = dict(samples)
            self.class_sizes = Counter(label for _, label in samples)
        label = self.labels[path]
        bad = sum(1 for p in self.bad_files if self.labels[p] == label)
        if bad == self.class_sizes[label]:
            log.warning(
                "every image of class %s (%d files) failed to decode: the model never sees that "
                "class; run `python -m fasttrain check-data DIR` to list them",
                Path(path).parent.name,
                bad,
            )

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if isinstance(self.sampler, TrainSampler):
            self.sampler.set_position(epoch, start_batch)

    def state_dict(self) -> dict:
        return {}  # augmentation is keyed on (seed, epoch, index): the step says it all

    def close(self) -> None:
        """Stop the worker processes now. They ignore SIGTERM (``_ignore_stop_signals``), so
        the terminate that Python's exit sends them would do nothing, and the exit would wait on
        them forever; asked through their queues, they end at once. DataLoader offers no public
        call for its persistent workers: this is the one its own destructor makes."""
        iterator = self.loader._iterator  # kept only with persistent workers, after an epoch
        if iterator is not None:
            iterator._shutdown_workers()
            self.loader._iterator = None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        non_blocking = self.device.type == "cuda"
        for images, labels, bad in self.loader:
            for paths in bad:
                for p in filter(None, paths.split(";")):
                    if p not in self.bad_files:
                        self.bad_files.add(p)
                        log.warning(
                            "skipped an undecodable image (%d so far): %s", len(self.bad_files), p
                        )
                        self._whole_class(p)
            with self.copy_clock.timing():
                x = images.to(self.device, non_blocking=non_blocking)  # uint8 NHWC
                if self.triton_normalize:  # one pass: read uint8, write dtype
                    x = self.normalize(
                        x, self.mean.view(3), 1 / self.inv_std.view(3), None, dtype=self.dtype
                    )
                else:  # the reference: a channels_last view, normalised elementwise
                    x = ((x.permute(0, 3, 1, 2).float() - self.mean) * self.inv_std).to(self.dtype)
                x = x.contiguous(memory_format=self.memory_format)  # a no-op for channels_last
                y = labels.to(self.device, non_blocking=non_blocking)
            yield x, y


def _ignore_stop_signals(worker_id: int) -> None:
    """Workers leave SIGTERM/SIGINT to the main process: a scheduler signals the whole process
    group, and a worker that died of it would fail the step the main process means to finish
    before its checkpoint. Workers still exit with their parent (DataLoader's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def build_torchvision_loader(
    samples: list[tuple[str, int]],
    *,
    train: bool,
    image_size: int,
    batch_size: int,
    workers: int,
    seed: int,
    rank: int,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    channels_last: bool,
    triton_normalize: bool = False,
    resize: int | None = None,
    auto_augment: str = "none",
    resolution: Resolution | None = None,
    batches: Mapping[int, int] | None = None,
) -> DeviceLoader:
    """``image_size``: the train crop, or val's center crop; ``resize``: val's shorter side
    before it (default ``val_resize(image_size)``); ``resolution``: train's crop per epoch;
    ``batches``: train's batch at each crop size, where it is not ``batch_size``."""
    dataset = ImageFolderDataset(samples, train, image_size, seed, resize, auto_augment, resolution)
    sampler: TrainSampler | ValSampler
    if train:
        sizes = resolution or Resolution.fixed(image_size)
        by_size = dict(batches or {})

        def batch_at(epoch: int) -> int:
            return sizes.batch_at(epoch, by_size, batch_size)

        sampler = TrainSampler(len(samples), rank, world, seed, batch_at)
        batching: dict = {"batch_sampler": sampler}
    else:
        sampler = ValSampler(len(samples), rank, world)
        batching = {"batch_size": batch_size, "sampler": sampler}
    loader = DataLoader(
        dataset,
        **batching,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=_ignore_stop_signals,
    )
    return DeviceLoader(loader, device, dtype, channels_last, sampler, triton_normalize)
