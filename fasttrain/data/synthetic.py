"""Fixed random tensors on the device: measures the step with the input pipeline taken out."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from fasttrain.config.resolution import Resolution
from fasttrain.data.loader import CopyClock

IMAGENET_TRAIN_IMAGES = 1_281_167


class SyntheticLoader:
    """Yields the same ``(images, labels)`` every step: no host work, no copies. Under a
    progressive ``resolution`` each size (and its batch, ``batches``) has its own fixed images,
    made when first used."""

    def __init__(
        self,
        *,
        batch_size: int,
        image_size: int,
        num_classes: int,
        steps: int | Callable[[int], int],
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        seed: int,
        resolution: Resolution | None = None,
        batches: Mapping[int, int] | None = None,
    ):
        """``steps``: batches per epoch, a number or a function of the batch size;
        ``batches``: the batch at each train size, where it is not ``batch_size``."""
        self.num_classes, self.device, self.dtype, self.seed = num_classes, device, dtype, seed
        self.batch_size = batch_size
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.resolution = resolution or Resolution.fixed(image_size)
        self.batches = dict(batches or {})
        self.by_shape: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps = steps
        self.start_batch = self.epoch = 0
        self.images, self.labels = self._tensors(0)
        self.fixed_buffers = True  # the same tensors every step: a CUDA graph reads them in place
        self.copy_clock = CopyClock()  # made on the device once: nothing to copy

    def batch_at(self, epoch: int) -> int:
        return self.resolution.batch_at(epoch, self.batches, self.batch_size)

    def batches_in(self, epoch: int) -> int:
        steps = self.steps
        return steps(self.batch_at(epoch)) if callable(steps) else steps

    def __len__(self) -> int:
        return self.batches_in(0)

    def _tensors(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        size, batch = self.resolution.size_at(epoch), self.batch_at(epoch)
        if (size, batch) not in self.by_shape:
            g = torch.Generator(device="cpu").manual_seed(self.seed)
            labels = torch.randint(0, self.num_classes, (batch,), generator=g).to(self.device)
            g = torch.Generator(device="cpu").manual_seed(self.seed + size)
            images = torch.randn(batch, 3, size, size, generator=g)
            images = images.to(self.device, self.dtype).contiguous(memory_format=self.memory_format)
            self.by_shape[size, batch] = images, labels
        return self.by_shape[size, batch]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start_batch = start_batch  # every epoch of a size yields the same tensors
        self.images, self.labels = self._tensors(epoch)
        self.epoch = epoch

    def close(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict:
        return {}  # nothing beyond the position, which follows from the step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.start_batch, self.batches_in(self.epoch)):
            yield self.images, self.labels
