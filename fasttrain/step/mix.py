"""Mixup and CutMix on the device, inside the step (``--mixup-alpha``, ``--cutmix-alpha``).

Each batch is mixed with itself rolled by one (torchvision's pairing): mixup blends whole images,
``lam * x + (1 - lam) * x.roll(1)``; CutMix pastes a box of the rolled batch, its side
``sqrt(1 - lam)`` of the image's, at a uniform centre, clipped to the image, and ``lam``
becomes the share of the image left. The targets are the one-hot labels mixed by the same
``lam``; the cross-entropy takes them as probabilities (and applies label smoothing to them).

Every random choice is a device tensor drawn from the mixer's own generator (seeded from
``--seed``): ``lam`` from Beta(alpha, alpha), the box centre, whether this batch mixes at all
(``--mixup-prob``) and, with both on, whether it takes CutMix (``--mixup-switch-prob``). The
mixing is then arithmetic on those tensors with ``torch.where``: no host reads and no shape
that depends on a draw, so the whole-step CUDA graph can hold it (the graph registers the
generator, so each replay draws anew). The generator is the mixer's alone, and its state is in
the checkpoint, so a resume draws what the uninterrupted run drew, whatever else consumed
torch's global generator in between (a DataLoader draws a seed from it at every epoch).
``apply`` takes the draws as arguments, so the tests hold it to torchvision's ``v2.MixUp`` /
``v2.CutMix`` on the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fasttrain.model.ops.memory_format import memory_format_of


@dataclass
class Draw:
    """One batch's random choices, 0-d device tensors."""

    lam: Tensor  # float: the Beta draw
    cx: Tensor  # int64: the CutMix box's centre, column and row
    cy: Tensor
    cutmix: Tensor  # bool: CutMix (else mixup)
    mix: Tensor  # bool: mix this batch at all


class Mixer:
    """Mixes a batch (module notes). ``mixup_alpha`` / ``cutmix_alpha``: 0 turns one off."""

    def __init__(
        self,
        num_classes: int,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        *,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        if mixup_alpha <= 0 and cutmix_alpha <= 0:
            raise ValueError("Mixer: mixup_alpha or cutmix_alpha must be positive")
        self.num_classes = num_classes
        self.mixup_alpha, self.cutmix_alpha = mixup_alpha, cutmix_alpha
        self.prob, self.switch_prob = prob, switch_prob
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def draw(self, height: int, width: int) -> Draw:
        g = self.generator
        device = g.device

        def beta(alpha: float) -> Tensor:  # Beta(a, a) is the first share of Dirichlet(a, a)
            return torch._sample_dirichlet(torch.full((2,), alpha, device=device), generator=g)[0]

        if self.mixup_alpha > 0 and self.cutmix_alpha > 0:
            cutmix = torch.rand((), device=device, generator=g) < self.switch_prob
            lam = torch.where(cutmix, beta(self.cutmix_alpha), beta(self.mixup_alpha))
        else:
            cutmix = torch.full((), self.cutmix_alpha > 0, device=device)
            lam = beta(self.cutmix_alpha if self.cutmix_alpha > 0 else self.mixup_alpha)
        cx = torch.randint(width, (), device=device, generator=g)
        cy = torch.randint(height, (), device=device, generator=g)
        mix = torch.rand((), device=device, generator=g) < self.prob
        return Draw(lam.float(), cx, cy, cutmix, mix)

    def __call__(self, images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(mixed images, soft targets) for a batch of images (N, C, H, W) and int labels."""
        d = self.draw(*images.shape[2:])
        return apply(
            images,
            labels,
            d,
            self.num_classes,
            mixup=self.mixup_alpha > 0,
            cutmix=self.cutmix_alpha > 0,
        )

    def state_dict(self) -> Tensor:
        """The generator's state: what the next draws will be."""
        return self.generator.get_state()

    def load_state_dict(self, state: Tensor) -> None:
        self.generator.set_state(state)


def cutmix_box(lam: Tensor, cx: Tensor, cy: Tensor, height: int, width: int) -> tuple[Tensor, ...]:
    """(x1, y1, x2, y2) as torchvision's CutMix computes them: half-sides ``int(r * size)`` with
    ``r = sqrt(1 - lam) / 2``, clipped to the image."""
    r = 0.5 * torch.sqrt(1.0 - lam.double())
    half_w, half_h = (r * width).floor().long(), (r * height).floor().long()
    x1, x2 = (cx - half_w).clamp(min=0), (cx + half_w).clamp(max=width)
    y1, y2 = (cy - half_h).clamp(min=0), (cy + half_h).clamp(max=height)
    return x1, y1, x2, y2


def apply(
    images: Tensor,
    labels: Tensor,
    d: Draw,
    num_classes: int,
    *,
    mixup: bool = True,
    cutmix: bool = True,
) -> tuple[Tensor, Tensor]:
    """Mix ``images`` and one-hot ``labels`` by the draws ``d`` (module notes). ``mixup`` /
    ``cutmix`` False: that kind is never drawn, so its images are not computed."""
    h, w = images.shape[2:]
    rolled = images.roll(1, 0)
    lam = d.lam.to(torch.float32)
    if mixup:
        mixed = (images.float() * lam + rolled.float() * (1 - lam)).to(images.dtype)
    if cutmix:
        x1, y1, x2, y2 = cutmix_box(d.lam, d.cx, d.cy, h, w)
        rows = torch.arange(h, device=images.device).view(h, 1)
        cols = torch.arange(w, device=images.device).view(1, w)
        box = (rows >= y1) & (rows < y2) & (cols >= x1) & (cols < x2)
        pasted = torch.where(box, rolled, images)
        cut_lam = (1 - (x2 - x1) * (y2 - y1) / (w * h)).to(torch.float32)
    if mixup and cutmix:
        out = torch.where(d.cutmix, pasted, mixed)
        lam = torch.where(d.cutmix, cut_lam, lam)
    elif cutmix:
        out, lam = pasted, cut_lam
    else:
        out = mixed
    out = torch.where(d.mix, out, images)
    lam = torch.where(d.mix, lam, torch.ones_like(lam))
    onehot = F.one_hot(labels, num_classes).float()
    targets = onehot * lam + onehot.roll(1, 0) * (1 - lam)
    return out.contiguous(memory_format=memory_format_of(images)), targets
