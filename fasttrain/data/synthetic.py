"""Fixed random tensors on the device: measures the step with the input pipeline taken out."""

from __future__ import annotations

from collections.abc import Iterator

import torch

IMAGENET_TRAIN_IMAGES = 1_281_167


class SyntheticLoader:
    """Yields the same ``(images, labels)`` every step: no host work, no copies."""

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
    ):
        g = torch.Generator(device="cpu").manual_seed(seed)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        images = torch.randn(batch_size, 3, image_size, image_size, generator=g)
        self.images = images.to(device=device, dtype=dtype).contiguous(memory_format=fmt)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=g).to(device)
        self.steps = steps
        self.start_batch = 0
        self.fixed_buffers = True  # the same tensors every step: a CUDA graph reads them in place

    def __len__(self) -> int:
        return self.steps

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start_batch = start_batch  # every epoch yields the same tensors

    def close(self) -> None:
        """Nothing to release."""

    def state_dict(self) -> dict:
        return {}  # nothing beyond the position, which follows from the step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.start_batch, self.steps):
            yield self.images, self.labels
