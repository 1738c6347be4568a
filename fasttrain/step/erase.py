"""Random erasing on the device, inside the step (``--random-erase P``).

torchvision's ``RandomErasing`` rule (Zhong et al. 2017), per image: with probability ``p``,
a box of area ``U(0.02, 0.33)`` of the image's and aspect ``exp(U(log 0.3, log 3.3))``, at a
uniform place, is set to 0, which after normalisation is the dataset's mean colour (the
reference recipe's ``value=0``). torchvision tries up to ten boxes until one fits; here the ten
are drawn at once for every image and the first that fits is taken, so the whole batch is a few
tensor ops with no host read and no shape that depends on a draw: the CUDA graph holds it.

The draws come from the eraser's own generator (seeded from ``--seed``, checkpointed per rank),
for the same reason as mixup's (``mix.py``). ``apply`` takes the box as arguments, so the tests
hold it to torchvision's ``v2.RandomErasing`` on the same box.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fasttrain.model.ops.memory_format import memory_format_of

SCALE = (0.02, 0.33)  # the box's share of the image
RATIO = (0.3, 3.3)  # its aspect, height / width
ATTEMPTS = 10


class Eraser:
    """Erases a box in a share ``p`` of the images of each batch (module notes)."""

    def __init__(self, p: float, *, device: torch.device | str = "cpu", seed: int = 0):
        self.p = p
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def draw(self, n: int, height: int, width: int) -> tuple[Tensor, ...]:
        """Per image: (top, left, box height, box width, erase?) as device tensors."""
        g, dev = self.generator, self.generator.device

        def uniform(lo: float, hi: float) -> Tensor:
            return torch.rand((n, ATTEMPTS), device=dev, generator=g) * (hi - lo) + lo

        area = height * width * uniform(*SCALE)
        aspect = torch.exp(uniform(math.log(RATIO[0]), math.log(RATIO[1])))
        h = torch.sqrt(area * aspect).round().long()
        w = torch.sqrt(area / aspect).round().long()
        fits = (h < height) & (w < width)
        first = fits.int().argmax(dim=1, keepdim=True)  # the first box that fits
        h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
        top = (torch.rand(n, device=dev, generator=g) * (height - h + 1)).floor().long()
        left = (torch.rand(n, device=dev, generator=g) * (width - w + 1)).floor().long()
        erase = (torch.rand(n, device=dev, generator=g) < self.p) & fits.any(dim=1)
        return top, left, h, w, erase

    def __call__(self, images: Tensor) -> Tensor:
        n, _, height, width = images.shape
        return apply(images, *self.draw(n, height, width))

    def state_dict(self) -> Tensor:
        return self.generator.get_state()

    def load_state_dict(self, state: Tensor) -> None:
        self.generator.set_state(state)


def apply(images: Tensor, top: Tensor, left: Tensor, h: Tensor, w: Tensor, erase: Tensor) -> Tensor:
    """``images`` (N, C, H, W) with each erased image's box (per-image tensors) set to 0."""
    _, _, height, width = images.shape
    rows = torch.arange(height, device=images.device).view(1, height, 1)
    cols = torch.arange(width, device=images.device).view(1, 1, width)
    top, left = top.view(-1, 1, 1), left.view(-1, 1, 1)
    box = (rows >= top) & (rows < top + h.view(-1, 1, 1))
    box = box & (cols >= left) & (cols < left + w.view(-1, 1, 1))
    box = box & erase.view(-1, 1, 1)
    erased = images.masked_fill(box.unsqueeze(1), 0)
    return erased.contiguous(memory_format=memory_format_of(images))
