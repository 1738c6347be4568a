"""DALI's pipeline definitions for the train and val loaders (``dali.py``).

Written with ``@pipeline_def`` and ``fn.*``; the same definition runs on the GPU (``mixed``
decoder) and in DALI's CPU mode (``device_id=None``).

- **Train:** reader → ``decoders.image_random_crop`` (area [0.08, 1], aspect [3/4, 4/3]) → resize
  → (``--auto-augment``: DALI's TrivialAugment Wide or RandAugment, through conditional
  execution) → ``crop_mirror_normalize`` with a random flip, fp16 NHWC.
- **Val:** decode → resize the shorter side → center crop → normalise.
"""

from __future__ import annotations

import re
from typing import Any

from fasttrain.data.torchvision import IMAGENET_MEAN, IMAGENET_STD

READER = "Reader"
# how DALI's file reader names the file it failed on ("File mapping failed: /path/x.jpg")
BAD_FILE = re.compile(r"([^\n:]*failed):\s*(/[^\n]+)")
# decoder scratch sized for ImageNet's largest images (NVIDIA's DeepLearningExamples values), so
# the hardware decoder does not reallocate mid-run
DEVICE_MEMORY_PADDING = 211_025_920
HOST_MEMORY_PADDING = 140_544_512


def pipelines():
    """(train, val): the pipeline functions, built on first use, so that importing fasttrain
    never needs DALI."""
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
