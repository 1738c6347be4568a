"""One loader contract for every backend.

A loader yields fixed-shape ``(images, labels)`` already on the device: images channels_last
(unless turned off) in a float dtype (the compute dtype, or DALI's fp16, which the step casts),
labels int64. See ``Loader``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fasttrain.config import DataConfig
from fasttrain.config.resolution import train_resolution
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError


class Loader(Protocol):
    """What the trainer, the step and the evaluator need of a loader."""

    # Every batch lands in the same tensors: a CUDA-graphed step reads them in place instead of
    # copying each batch into buffers of its own.
    fixed_buffers: bool

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


def build_data(
    cfg: DataConfig,
    *,
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
    """Build the train and val loaders ``cfg.loader`` names; ``loader_state`` resumes the train
    loader from a checkpoint's ``state_dict()``. The train loader crops each epoch at the size
    ``--image-size`` or ``--progressive-resizing`` gives it (``resolution.py``), in batches of
    ``batch_size``, or of ``batches[size]`` where given (``--batch-size auto``)."""
    resolution = train_resolution(cfg)
    # the train crop and batch of each epoch
    sizes = {"image_size": resolution.size_at(0), "resolution": resolution, "batches": batches}
    if cfg.loader == "synthetic":
        from fasttrain.data.synthetic import IMAGENET_TRAIN_IMAGES, SyntheticLoader

        classes = num_classes or 1000

        def steps(batch: int) -> int:
            """Optimizer steps per epoch: --synthetic-steps, or an ImageNet epoch's."""
            return cfg.synthetic_steps or IMAGENET_TRAIN_IMAGES // (
                batch * dist.world_size * accum_steps
            )

        def micro_batches(batch: int) -> int:  # what the loader yields per epoch
            return steps(batch) * accum_steps

        train = SyntheticLoader(
            batch_size=batch_size,
            **sizes,
            num_classes=classes,
            steps=micro_batches,
            device=dist.device,
            dtype=dtype,
            channels_last=channels_last,
            seed=seed,
        )
        return Data(train, None, classes, f"synthetic ({steps(batch_size)} steps per epoch)")

    from fasttrain.data.folder import scan_folder
    from fasttrain.data.torchvision import build_torchvision_loader

    assert cfg.path is not None, "resolve() fills data.path"
    exclude: set[str] = set()
    if cfg.exclude_list is not None:
        from fasttrain.data.check import read_exclude_list

        if not Path(cfg.exclude_list).is_file():
            raise UserError(f"--exclude-list {cfg.exclude_list}: no such file")
        exclude = read_exclude_list(cfg.exclude_list)
    ds = scan_folder(cfg.path, exclude)
    classes = len(ds.classes)
    if num_classes is not None and num_classes < classes:
        raise UserError(
            f"--num-classes {num_classes}: {cfg.path}/train has {classes} class "
            "folders; use at least that many or leave --num-classes out"
        )
    per_rank = len(ds.train) // dist.world_size
    largest = max([batch_size, *(batches or {}).values()])
    if per_rank < largest:
        raise UserError(
            f"--batch-size {largest}: {cfg.path}/train has only {len(ds.train)} "
            f"images ({per_rank} per process), less than one batch; lower --batch-size"
        )
    common = dict(
        batch_size=batch_size,
        seed=seed,
        rank=dist.rank,
        world=dist.world_size,
        device=dist.device,
        dtype=dtype,
        channels_last=channels_last,
    )
    if cfg.loader == "dali":
        from fasttrain.data.dali import DaliLoader  # it says how to install DALI if it is missing

        common.pop("dtype")  # DALI hands over fp16; the step casts it to the compute dtype
        dali = dict(
            threads=cfg.dali_threads,
            hw_decoder_load=cfg.dali_hw_decoder_load,
            prefetch=cfg.dali_prefetch,
            local_rank=dist.local_rank,
            **common,
        )
        train = DaliLoader(
            ds.train,
            train=True,
            buffers=accum_steps,
            state=loader_state,
            auto_augment=cfg.auto_augment,
            **sizes,
            **dali,
        )
        val = DaliLoader(ds.val, train=False, **{**dali, **_val_sizes(cfg)})
        how = (
            f"DALI loader ({'GPU' if dist.device.type == 'cuda' else 'CPU'} decode, "
            f"{cfg.dali_threads} threads, {cfg.dali_prefetch} batches ahead)"
        )
    else:
        tv = dict(workers=cfg.workers, triton_normalize=triton_normalize, **common)
        train = build_torchvision_loader(
            ds.train, train=True, auto_augment=cfg.auto_augment, **sizes, **tv
        )
        val = build_torchvision_loader(ds.val, train=False, **{**tv, **_val_sizes(cfg)})
        how = f"torchvision loader with {cfg.workers} workers"
    return Data(
        train,
        val,
        num_classes or classes,
        f"{cfg.path}: {len(ds.train):,} train / {len(ds.val):,} val images, "
        f"{classes} classes, {how}"
        + (f"; leaving out the {len(exclude)} files in {cfg.exclude_list}" if exclude else ""),
    )


def _val_sizes(cfg: DataConfig) -> dict:
    """A val loader's crop (``image_size``) and resize, from --val-crop-size and
    --val-resize-size."""
    return {"image_size": cfg.val_crop_size or cfg.image_size, "resize": cfg.val_resize_size}


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
    from fasttrain.data.folder import scan_eval_folder
    from fasttrain.data.torchvision import build_torchvision_loader

    if cfg.loader == "synthetic":
        raise UserError("--loader synthetic has no val images to evaluate; give --data")
    assert cfg.path is not None, "resolve() fills data.path"
    ds = scan_eval_folder(cfg.path)
    common = dict(
        **_val_sizes(cfg),
        batch_size=batch_size,
        seed=0,
        rank=dist.rank,
        world=dist.world_size,
        device=dist.device,
        channels_last=channels_last,
    )
    if cfg.loader == "dali":
        from fasttrain.data.dali import DaliLoader

        val = DaliLoader(
            ds.val,
            train=False,
            threads=cfg.dali_threads,
            hw_decoder_load=cfg.dali_hw_decoder_load,
            prefetch=cfg.dali_prefetch,
            local_rank=dist.local_rank,
            **common,
        )
        how = "DALI loader"
    else:
        val = build_torchvision_loader(
            ds.val,
            train=False,
            workers=cfg.workers,
            dtype=dtype,
            triton_normalize=triton_normalize,
            **common,
        )
        how = f"torchvision loader with {cfg.workers} workers"
    return (
        val,
        len(ds.classes),
        f"{ds.root}: {len(ds.val):,} images, {len(ds.classes)} classes, {how}",
    )
