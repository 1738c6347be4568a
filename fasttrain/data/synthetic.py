"""Fixed random tensors on the device: measures the step with the input pipeline taken out."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fasttrain.resolution import Resolution

IMAGENET_TRAIN_IMAGES = 1_281_167


class SyntheticLoader:
    """Yields the same ``(images, labels)`` every step: no host work, no copies. Under a
    progressive ``resolution`` each size has its own fixed images, made when first used."""

    def __init__(
        self,
        *,
        batch_size: int,
        image_size: int,
        num_classes: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype,
        channels_last: bool,
        seed: int,
        resolution: Resolution | None = None,
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
        self.batch_size, self.device, self.dtype, self.seed = batch_size, device, dtype, seed
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.resolution = resolution or Resolution.fixed(image_size)
        self.by_size: dict[int, torch.Tensor] = {}
        self.images = self._images(self.resolution.size_at(0))
        self.steps = steps
        self.start_batch = 0
        self.fixed_buffers = True  # the same tensors every step: a CUDA graph reads them in place

    def __len__(self) -> int:
        return self.steps

    def _images(self, size: int) -> torch.Tensor:
        if size not in self.by_size:
            g = torch.Generator(device="cpu").manual_seed(self.seed + size)
            images = torch.randn(self.batch_size, 3, size, size, generator=g)
            self.by_size[size] = images.to(self.device, self.dtype).contiguous(
                memory_format=self.memory_format
            )
        return self.by_size[size]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start_batch = start_batch  # every epoch of a size yields the same tensors
        self.images = self._images(self.resolution.size_at(epoch))

    def close(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict:
        return {}  # nothing beyond the position, which follows from the step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.start_batch, self.steps):
            yield self.images, self.labels
