"""A run's loaders from the config: the train and val loaders of the backend ``--loader`` names
(``build_data``), or the val loader alone for ``evaluate`` (``build_eval_data``). Each backend's
loaders are built in one function of its own; training and ``evaluate`` build their val loaders
through the same one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fasttrain.config import DataConfig
from fasttrain.config.resolution import Resolution
from fasttrain.data.folder import FolderDataset, scan_eval_folder, scan_folder
from fasttrain.data.loader import Data, Loader
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError

Samples = list[tuple[str, int]]


@dataclass(frozen=True)
class Feed:
    """What every loader of a run shares: its batch, its process, what it hands the step."""

    batch_size: int
    seed: int
    dist: DistState
    dtype: torch.dtype  # the torchvision loader's output (DALI hands over fp16)
    channels_last: bool
    triton_normalize: bool = False  # the torchvision loader's normalise, as a Triton kernel


def build_data(
    cfg: DataConfig,
    *,
    resolution: Resolution,
    batch_size: int,
    num_classes: int | None,
    seed: int,
    dist: DistState,
    dtype: torch.dtype,
    channels_last: bool,
    accum_steps: int,
    loader_state: dict | None = None,
    triton_normalize: bool = False,
    batches: Mapping[int, int] | None = None,
) -> Data:
    """The train and val loaders ``cfg.loader`` names. The train loader crops each epoch at
    ``resolution``'s size, in batches of ``batch_size``, or of ``batches[size]`` where given;
    ``loader_state`` resumes it from a checkpoint's ``state_dict()``."""
    feed = Feed(batch_size, seed, dist, dtype, channels_last, triton_normalize)
    batches = dict(batches or {})
    if cfg.loader == "synthetic":
        return _synthetic(cfg, feed, resolution, batches, num_classes, accum_steps)
    assert cfg.path is not None, "resolve() fills data.path"
    exclude = _exclusions(cfg)
    ds = scan_folder(cfg.path, exclude)
    classes = len(ds.classes)
    if num_classes is not None and num_classes < classes:
        raise UserError(
            f"--num-classes {num_classes}: {cfg.path}/train has {classes} class "
            "folders; use at least that many or leave --num-classes out"
        )
    per_rank = len(ds.train) // dist.world_size
    largest = max([batch_size, *batches.values()])
    if per_rank < largest:
        raise UserError(
            f"--batch-size {largest}: {cfg.path}/train has only {len(ds.train)} "
            f"images ({per_rank} per process), less than one batch; lower --batch-size"
        )
    train = _train_loader(cfg, ds.train, feed, resolution, batches, accum_steps, loader_state)
    return Data(
        train,
        _val_loader(cfg, ds.val, feed),
        num_classes or classes,
        f"{cfg.path}: {len(ds.train):,} train / {len(ds.val):,} val images, "
        f"{classes} classes, {describe(cfg, dist)}"
        + (f"; leaving out the {len(exclude)} files in {cfg.exclude_list}" if exclude else ""),
    )


def build_eval_data(
    cfg: DataConfig,
    *,
    batch_size: int,
    dist: DistState,
    dtype: torch.dtype,
    channels_last: bool,
    triton_normalize: bool = False,
) -> tuple[Loader, int, str]:
    """The val loader alone, for ``evaluate``: ``--data``'s val/ (or the folder itself, see
    ``scan_eval_folder``) through the loader ``cfg.loader`` names. Returns the loader, the
    class count and a description."""
    if cfg.loader == "synthetic":
        raise UserError("--loader synthetic has no val images to evaluate; give --data")
    assert cfg.path is not None, "resolve() fills data.path"
    ds: FolderDataset = scan_eval_folder(cfg.path)
    feed = Feed(batch_size, 0, dist, dtype, channels_last, triton_normalize)
    return (
        _val_loader(cfg, ds.val, feed),
        len(ds.classes),
        f"{ds.root}: {len(ds.val):,} images, {len(ds.classes)} classes, {describe(cfg, dist)}",
    )


def describe(cfg: DataConfig, dist: DistState) -> str:
    """The loader in use, for the start-up line."""
    if cfg.loader == "dali":
        decode = "GPU" if dist.device.type == "cuda" else "CPU"
        return (
            f"DALI loader ({decode} decode, {cfg.dali_threads} threads, {cfg.dali_prefetch} "
            "batches ahead)"
        )
    return f"torchvision loader with {cfg.workers} workers"


def _exclusions(cfg: DataConfig) -> set[str]:
    """The files ``--exclude-list`` (or check-data's list for ``--data``) leaves out."""
    if cfg.exclude_list is None:
        return set()
    from fasttrain.data.check import read_exclude_list

    if not Path(cfg.exclude_list).is_file():
        raise UserError(f"--exclude-list {cfg.exclude_list}: no such file")
    return read_exclude_list(cfg.exclude_list)


def _synthetic(
    cfg: DataConfig,
    feed: Feed,
    resolution: Resolution,
    batches: dict[int, int],
    num_classes: int | None,
    accum_steps: int,
) -> Data:
    """Fixed random tensors on the device: no val set."""
    from fasttrain.data.synthetic import IMAGENET_TRAIN_IMAGES, SyntheticLoader

    classes, world = num_classes or 1000, feed.dist.world_size

    def steps(batch: int) -> int:
        """Optimizer steps per epoch: --synthetic-steps, or an ImageNet epoch's."""
        return cfg.synthetic_steps or IMAGENET_TRAIN_IMAGES // (batch * world * accum_steps)

    train = SyntheticLoader(
        batch_size=feed.batch_size,
        image_size=resolution.size_at(0),
        resolution=resolution,
        batches=batches,
        num_classes=classes,
        steps=lambda batch: steps(batch) * accum_steps,  # the micro-batches of an epoch
        device=feed.dist.device,
        dtype=feed.dtype,
        channels_last=feed.channels_last,
        seed=feed.seed,
    )
    return Data(train, None, classes, f"synthetic ({steps(feed.batch_size)} steps per epoch)")


def _train_loader(
    cfg: DataConfig,
    samples: Samples,
    feed: Feed,
    resolution: Resolution,
    batches: dict[int, int],
    accum_steps: int,
    state: dict | None,
) -> Loader:
    sizes = dict(image_size=resolution.size_at(0), resolution=resolution, batches=batches)
    if cfg.loader == "dali":
        from fasttrain.data.dali import build_dali_loader  # it says how to install DALI

        return build_dali_loader(
            samples,
            train=True,
            buffers=accum_steps,
            state=state,
            auto_augment=cfg.auto_augment,
            **sizes,
            **_dali(cfg, feed),
        )
    from fasttrain.data.torchvision import build_torchvision_loader

    return build_torchvision_loader(
        samples, train=True, auto_augment=cfg.auto_augment, **sizes, **_torchvision(cfg, feed)
    )


def _val_loader(cfg: DataConfig, samples: Samples, feed: Feed) -> Loader:
    """A val loader: the center crop (--val-crop-size, else --image-size) after the resize
    (--val-resize-size, else the crop / 0.875)."""
    sizes = dict(image_size=cfg.val_crop_size or cfg.image_size, resize=cfg.val_resize_size)
    if cfg.loader == "dali":
        from fasttrain.data.dali import build_dali_loader

        return build_dali_loader(samples, train=False, **sizes, **_dali(cfg, feed))
    from fasttrain.data.torchvision import build_torchvision_loader

    return build_torchvision_loader(samples, train=False, **sizes, **_torchvision(cfg, feed))


def _common(feed: Feed) -> dict:
    """Every loader's arguments: its batch and seed, its shard, its device and layout."""
    d = feed.dist
    return dict(
        batch_size=feed.batch_size,
        seed=feed.seed,
        rank=d.rank,
        world=d.world_size,
        device=d.device,
        channels_last=feed.channels_last,
    )


def _dali(cfg: DataConfig, feed: Feed) -> dict:
    """A DALI loader's arguments (it hands over fp16, which the step casts)."""
    return dict(
        threads=cfg.dali_threads,
        hw_decoder_load=cfg.dali_hw_decoder_load,
        prefetch=cfg.dali_prefetch,
        **_common(feed),
    )


def _torchvision(cfg: DataConfig, feed: Feed) -> dict:
    return dict(
        workers=cfg.workers,
        dtype=feed.dtype,
        triton_normalize=feed.triton_normalize,
        **_common(feed),
    )
