"""torchvision's ResNet with each BatchNorm, the residual add and the ReLU after it run as one
op (``bn_act``): the ``--cudnn-bn`` model path, on cuDNN's standalone fused BatchNorm kernels.

``BNActResNet`` *is* a ``torchvision.models.ResNet`` (same modules, same constructor, so the same
seed gives the same weights, and the same state dict); only ``forward`` differs:

    bottleneck(x):  a = bn_act(conv1(x), bn1)                 # BN + ReLU
                    a = bn_act(conv2(a), bn2)
                    identity = x, or bn_act(conv_d(x), bn_d, relu=False)
                    out = bn_act(conv3(a), bn3, residual=identity)   # BN + add + ReLU

The stem's BN + ReLU runs as ``bn_act`` too. Unlike ``FusedResNet`` (``--fused-bn``), which
folds the statistics into the convolutions (fp16 only), this runs in bf16 as well.
"""

from __future__ import annotations

import torch
import torchvision
from torch import Tensor
from torchvision.models.resnet import BasicBlock, Bottleneck

from fasttrain.model.fused_resnet import BLOCKS
from fasttrain.model.ops.bn_act import batch_norm_act


def _identity(block: BasicBlock | Bottleneck, x: Tensor) -> Tensor:
    if block.downsample is None:
        return x
    conv, bn = block.downsample[0], block.downsample[1]
    return batch_norm_act(conv(x), bn, relu=False)


def _bottleneck(block: Bottleneck, x: Tensor) -> Tensor:
    a = batch_norm_act(block.conv1(x), block.bn1)
    a = batch_norm_act(block.conv2(a), block.bn2)
    return batch_norm_act(block.conv3(a), block.bn3, residual=_identity(block, x))


def _basic(block: BasicBlock, x: Tensor) -> Tensor:
    a = batch_norm_act(block.conv1(x), block.bn1)
    return batch_norm_act(block.conv2(a), block.bn2, residual=_identity(block, x))


class BNActResNet(torchvision.models.ResNet):
    """A torchvision ResNet whose BatchNorms run with their add and ReLU as one op (module
    notes). ``arch`` is one of ``BLOCKS``; the rest is ``ResNet``'s arguments."""

    def __init__(self, arch: str, **kwargs):
        block, layers = BLOCKS[arch]
        super().__init__(block, layers, **kwargs)
        self.run_block = _bottleneck if block is Bottleneck else _basic

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(batch_norm_act(self.conv1(x), self.bn1))
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in layer:
                x = self.run_block(block, x)
        return self.fc(torch.flatten(self.avgpool(x), 1))
