"""Whether the fused BatchNorm path runs on this machine: the convolutions ``FusedResNet`` sends
through cuDNN's convolution + statistics graph, at a run's batch and image sizes, and the ones
cuDNN has no engine for.

``--fused-bn auto`` takes the fused path only where every one of them runs (``check``), and
otherwise says why in one line; ``--fused-bn on`` refuses to start on a GPU where any would fall
back to the plain-PyTorch reference. The question is asked at start-up, from shapes alone: the
model is walked on the meta device, and cuDNN's heuristics are asked for each shape without
building or timing a plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torchvision
from torch import nn

from fasttrain.model.cudnn import graph as cudnn_graph
from fasttrain.model.fused_resnet import FOLD


@dataclass(frozen=True)
class ConvShape:
    """One convolution as cuDNN sees it: NCHW sizes of its input and weight (both NHWC in
    memory, fp16), its stride and padding, and whether it reads the previous BN as it loads."""

    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    stride: int
    padding: int
    prologue: bool = False

    def __str__(self) -> str:
        k, c, r, s = self.w
        return f"{r}x{s} conv {c}->{k} stride {self.stride} on {'x'.join(map(str, self.x))}" + (
            " with the previous BN folded in" if self.prologue else ""
        )


@dataclass(frozen=True)
class FusedSupport:
    """What ``check`` found: the model's cuDNN convolutions, those declined, and why nothing
    could be asked where that is the case."""

    shapes: tuple[ConvShape, ...] = ()
    declined: tuple[ConvShape, ...] = ()
    unavailable: str | None = None  # no GPU, no frontend: cuDNN was not asked
    cudnn: int | None = None  # cuDNN's version, as the frontend reports it (91900: 9.19)

    @property
    def runs(self) -> bool:
        return self.unavailable is None and not self.declined

    def why_not(self) -> str:
        """One line: why the fused path cannot run here."""
        if self.unavailable is not None:
            return self.unavailable
        version = "cuDNN"
        if self.cudnn:
            version += f" {self.cudnn // 10000}.{self.cudnn // 100 % 100}"
        return (
            f"{version} on this GPU ({_gpu_name()}) has no fused convolution + statistics for "
            f"{len(self.declined)} of the model's {len(self.shapes)} convolution shapes: "
            + "; ".join(map(str, self.declined))
        )


def conv_shapes(arch: str, batch: int, sizes: Iterable[int]) -> tuple[ConvShape, ...]:
    """The convolutions ``FusedResNet(arch)`` runs through cuDNN (every one but the stem's,
    which sums its statistics in a reduction of its own), at ``batch`` and each square image
    size in ``sizes``, each distinct shape once, in the order the forward meets them."""
    with torch.device("meta"):
        model = getattr(torchvision.models, arch)(weights=None)
    reads_bn = {  # the convolutions that read a BN's output inside a block
        conv for block in _blocks(model) for conv in (block.conv2, getattr(block, "conv3", None))
    }
    found: dict[ConvShape, None] = {}

    def record(conv: nn.Conv2d, args: tuple) -> None:
        found[
            ConvShape(
                tuple(args[0].shape),
                tuple(conv.weight.shape),
                conv.stride[0],
                conv.padding[0],
                conv in reads_bn and conv.kernel_size[0] in FOLD,
            )
        ] = None

    hooks = [
        m.register_forward_pre_hook(record)
        for m in model.modules()
        if isinstance(m, nn.Conv2d) and m is not model.conv1
    ]
    try:
        for size in sizes:
            model(torch.empty(batch, 3, size, size, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return tuple(found)


def check(arch: str, batch: int, sizes: Iterable[int], device: torch.device) -> FusedSupport:
    """Whether cuDNN on ``device`` runs every convolution of the fused ``arch`` at ``batch``
    and ``sizes`` (see the module notes)."""
    if device.type != "cuda":
        return FusedSupport(unavailable="it needs a CUDA GPU")
    if not cudnn_graph.available():
        return FusedSupport(
            unavailable="the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend; "
            "fasttrain's own install brings it on Linux)"
        )
    from fasttrain.model.cudnn import conv_bn as cudnn_conv_bn

    shapes = conv_shapes(arch, batch, sizes)
    declined = tuple(
        s
        for s in shapes
        if not cudnn_conv_bn.supported(s.x, s.w, s.stride, s.padding, s.prologue, device)
    )
    return FusedSupport(shapes, declined, cudnn=cudnn_graph.version())


def _blocks(model: torchvision.models.ResNet) -> list[nn.Module]:
    return [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4)
            for block in layer]  # fmt: skip


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
