"""The ``data`` section: where the images come from and how they are loaded and augmented."""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config.option import option


@dataclass
class DataConfig:
    path: str | None = option(
        None,
        "--data",
        "dataset root holding train/ and val/ class folders (ImageFolder layout); omit it to "
        "use the built-in sample dataset",
        nullable=True,
    )
    loader: str = option(
        "auto",
        "--loader",
        "input pipeline: dali (NVIDIA DALI: decode and augment on the GPU, or on the CPU "
        "without one; installed with fasttrain on Linux), torchvision (ImageFolder, CPU "
        "decode, uint8 to the GPU), synthetic (fixed random tensors on the device, for "
        "benchmarks), or auto: dali where DALI and a GPU are present, else torchvision",
        choices=("auto", "dali", "torchvision", "synthetic"),
    )
    exclude_list: str | None = option(
        None,
        "--exclude-list",
        "images to leave out, one path per line, as `python -m fasttrain check-data DIR` writes "
        "(default: the list check-data wrote for --data, if there is one)",
        nullable=True,
    )
    image_size: int = option(
        224,
        "--image-size",
        "train crop size in pixels; val resizes the shorter side to size/0.875 and "
        "center-crops this size, unless --val-resize-size / --val-crop-size say otherwise",
        minimum=16,
        aliases=("--train-crop-size",),
    )
    progressive_resizing: str | None = option(
        None,
        "--progressive-resizing",
        "train at a size that grows over the run, FFCV's progressive resizing: START px up to "
        "epoch FROM_EPOCH, END px from epoch TO_EPOCH, linearly in between rounded to a "
        "multiple of 32 (epochs count from 0; FFCV's ResNet-50 recipes use 160:192). It takes "
        "the place of --image-size for training, and val's default crop is END. Each size "
        "compiles and captures its own step once; --batch-size auto finds each size's batch "
        "(--batch-sizes). YAML: the same string, or a list of the four numbers; none: off",
        nullable=True,
        parts=4,
        metavar="START:END:FROM_EPOCH:TO_EPOCH",
    )
    auto_augment: str = option(
        "none",
        "--auto-augment",
        "train: TrivialAugment Wide (ta_wide) or RandAugment (ra: 2 ops, magnitude 9) on each "
        "crop, on the GPU in DALI's pipeline or by torchvision's transforms in the torchvision "
        "loader; none: off",
        choices=("none", "ta_wide", "ra"),
    )
    val_resize_size: int | None = option(
        None,
        "--val-resize-size",
        "val: resize the shorter side to this many pixels before the center crop (default: "
        "the crop size / 0.875, 256 for 224)",
        minimum=16,
        nullable=True,
    )
    val_crop_size: int | None = option(
        None,
        "--val-crop-size",
        "val: the center crop in pixels (default: --image-size)",
        minimum=16,
        nullable=True,
    )
    workers: int | None = option(
        None,
        "--workers",
        "torchvision loader worker processes per GPU (default: one per CPU core, at most 16)",
        minimum=0,
        nullable=True,
        aliases=("-j",),
    )
    synthetic_steps: int = option(
        0,
        "--synthetic-steps",
        "steps per epoch with --loader synthetic; 0 means an ImageNet-sized epoch "
        "(1,281,167 images)",
        minimum=0,
    )
    dali_threads: int = option(
        8, "--dali-threads", "with --loader dali: CPU threads per process", minimum=1
    )
    dali_prefetch: int = option(
        4,
        "--dali-prefetch",
        "with --loader dali: batches decoded ahead of the step (DALI's prefetch queue depth; "
        "deeper than DALI's 2 so that decode sharing the GPU with the step never makes it wait)",
        minimum=1,
    )
    dali_hw_decoder_load: float = option(
        0.99,
        "--dali-hw-decoder-load",
        "with --loader dali on a GPU: share of JPEGs sent to the hardware JPEG decoder (0 to 1; "
        "the rest decode on the GPU's SMs)",
        minimum=0,
        maximum=1,
    )
