"""torchvision's ResNet, run with BatchNorm folded into the convolutions (``conv_bn``).

``FusedResNet`` *is* a ``torchvision.models.ResNet``: the same modules, built by the same
constructor (so the same seed gives the same weights), and the same state dict, so a checkpoint
of either loads into the other. Only ``forward`` differs: each block runs on ``conv_bn`` and
``bn_finalize`` instead of ``Conv2d -> BatchNorm2d -> ReLU``:

    bottleneck(x):  a1, s1 = conv_bn(x)                       # BN1's statistics as conv1 writes
                    a2, s2 = conv_bn(relu(BN1(a1)))           # BN1 from s1: no statistics pass
                    a3, s3 = conv_bn(relu(BN2(a2)))
                    identity = x, or BN_d(conv_bn(x))         # the downsample branch
                    out = relu(BN3(a3) + identity)            # one elementwise pass

So each BN costs one elementwise pass (normalise + ReLU, which inductor fuses with its
neighbours) instead of plain BN's statistics pass and normalise pass; the pass's ReLU gradient
is masked by the convolution output it read (``affine_relu``), which the BN's backward kernels
read anyway, not by the pass's output, one read of each activation fewer. ``conv_bn`` can also apply
the normalise + ReLU as the convolution reads its input (``fold``: the prologue), leaving no pass
at all; measured in the whole step, that is slower (``FOLD``), but it saves memory. The BN that
ends a block (and the downsample's) has no convolution after it inside the block, so it is
applied with the residual add and the ReLU, in one elementwise pass, whose masked gradient is
stored once for its three readers (``residual_relu``); the ReLU's mask that the gradient needs is
kept as one bit per element, written by the same pass (``pack_block_mask``), so the backward
does not read the block's output for it. The stem's 3-channel convolution is one
cuDNN's fusion declines to sum for, so its statistics come from one reduction over its output,
and its normalise + ReLU is the other BNs' pass, or happens inside fasttrain's Triton max-pool
where the model runs it. That convolution reads its 3-channel image padded with a zero channel
to 4 (``pad_stem``): the same output, from cuDNN's faster 4-channel kernels. In fp16 each
convolution's fp32 weight is cast once and the cast kept for the backward (``cast_once``).
In training, the forward counts the batch in every BN's ``num_batches_tracked`` with one
multi-tensor add before the first BN (``count_once``), one kernel where each BN's own count is one
of a single element. ``FusedResNet(store_block_grad=False, fuse_stem=False, pad_stem=False,
cast_once=False, pack_block_mask=False, count_once=False)`` is the block end, the stem, the
weights' casts and the counts as torch computes them (the references they are measured against).
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from fasttrain.model.ops.bn_pool import affine_relu_max_pool2d, bn_relu_max_pool2d
from fasttrain.model.ops.conv_bn import (
    affine,
    affine_relu,
    bn_finalize,
    cast_weight,
    conv_bn,
    count_batches,
    residual_relu,
    sums,
)

BLOCKS = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
    "resnet101": (Bottleneck, [3, 4, 23, 3]),
    "resnet152": (Bottleneck, [3, 8, 36, 3]),
}
ALL = frozenset({1, 3})  # the kernel sizes of every convolution that reads a BN: all of them
# The kernel sizes whose convolutions fold the previous BN's normalise + ReLU in by default: none.
# Measured in the whole step (docs/DESIGN.md), folding it in cost more than it saved: cuDNN's
# prologue kernels are slower than the bare convolution by about one elementwise pass, and the
# backward must then recompute the prologue for wgrad (a separate pass's output is an ordinary
# tensor, which the compiled backward keeps or recomputes as inductor's partitioner chooses).
# Folding it in still saves memory (the normalised activations are never stored).
FOLD = frozenset()
# What the stem's convolution pads its image's channels to: cuDNN's channels_last fp16 kernels for
# 4 input channels run its forward and weight gradient in 0.40 ms each at batch 256 on an H200,
# against 0.56 ms for 3 (8 channels, or the image rearranged to 12 channels at half the size,
# were slower still: docs/DESIGN.md)
STEM_CHANNELS = 4


Prologue = tuple[Tensor, Tensor]  # a BN's per-channel scale and bias, from ``bn_finalize``


@dataclass(frozen=True)
class Fusion:
    """How a BN before a convolution is applied: folded into the convolutions whose kernel
    sizes are in ``fold``, else as an elementwise pass whose ReLU backward masks by the
    convolution output it read (``mask_from_input``, the default: ``affine_relu``, one read
    fewer in each of the BN's two backward kernels, 2-3% faster steps) or by its own output
    (``torch.relu``, the simple reference). With ``store_block_grad`` (the default), each
    block's end stores its masked gradient once for its three readers (``residual_relu``)
    instead of leaving inductor to recompute it in each (3.5% faster steps). With ``fuse_stem``
    (the default), the stem's BN runs as the others that no convolution sums for: its
    statistics by one reduction, its normalise + ReLU as the pass above or inside the Triton
    max-pool (``_stem``; 1.6% faster steps, 3.4% with ``store_block_grad``); with
    ``stem_bn_in_pool`` as well, the pool takes the whole BN in training, and its backward
    writes the convolution output's gradient in one pass (``bn_relu_max_pool2d``) rather than
    the pool's gradient for inductor's BN backward to read twice (less GPU time alone, no faster
    in the step on an H200, 0.1 GiB more memory: off by default). With ``pad_stem``
    (the default), the stem's convolution reads its image with zero channels added up to
    ``STEM_CHANNELS``, and its weights likewise (``_stem_conv``). With ``cast_once`` (the
    default), each convolution's fp32 weight is cast to the activations' dtype once and the
    cast kept for the backward (``cast_weight``; 0.3-0.4% faster steps) rather than cast again
    there. With ``pack_block_mask`` (the default, with ``store_block_grad``), each block end
    keeps its ReLU's mask as one bit per element for the backward instead of reading its output
    there (``residual_relu``; 2.1% faster steps in ``default`` mode). Each normalise pass saves
    its scale and bias for the backward as the tensors themselves, marked ``stored`` (the
    default: no copy kernels, 0.1% faster steps), or with ``copy_affine`` as copies (``kept``).
    With ``count_once`` (the default), the forward counts the batch in every BN it finalizes
    with one multi-tensor add (``count_batches``), not one single-element kernel per BN."""

    fold: frozenset[int] = FOLD
    mask_from_input: bool = True
    store_block_grad: bool = True
    fuse_stem: bool = True
    pad_stem: bool = True
    cast_once: bool = True
    stem_bn_in_pool: bool = False
    pack_block_mask: bool = True
    copy_affine: bool = False
    count_once: bool = True


def _conv(
    x: Tensor, conv: nn.Conv2d, prologue: Prologue | None = None, *, how: Fusion
) -> tuple[Tensor, Tensor, Tensor]:
    """``conv(relu(prologue(x)))`` and its output's sums. The prologue is folded into the
    convolution where its kernel size is in ``how.fold``, else applied as an elementwise pass
    first, which inductor fuses with its neighbours."""
    scale, bias = prologue if prologue is not None else (None, None)
    if prologue is not None and conv.kernel_size[0] not in how.fold:
        x, scale, bias = _normalise_relu(x, prologue, how), None, None
    weight = conv.weight
    if how.cast_once and weight.dtype != x.dtype:
        weight = cast_weight(weight, x.dtype)
    return conv_bn(x, weight, scale, bias, conv.stride[0], conv.padding[0])


def _normalise_relu(y: Tensor, prologue: Prologue, how: Fusion) -> Tensor:
    """A BN's normalise + ReLU as an elementwise pass, its backward masked as ``how`` says."""
    if how.mask_from_input:
        return affine_relu(y, *prologue, copy_affine=how.copy_affine)
    return _relu_of_affine(y, *prologue)


def _relu_of_affine(y: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """``affine_relu``'s forward, with torch.relu's backward (it masks by reading the output)."""
    return torch.relu(affine(y, scale, bias))


def _bn(y: Tensor, total: Tensor, total_sq: Tensor, bn: nn.BatchNorm2d, how: Fusion) -> Prologue:
    """``bn``'s scale and bias for ``y``, whose sums ``conv_bn`` returned; its batch counted
    already where ``how.count_once`` (``FusedResNet.forward``)."""
    count = y.shape[0] * y.shape[2] * y.shape[3]
    return bn_finalize(total, total_sq, count, bn, counted=how.count_once)


def _stem(model: torchvision.models.ResNet, x: Tensor, how: Fusion) -> Tensor:
    """The stem: conv1, bn1, the ReLU and the max-pool, as torchvision runs them or, with
    ``how.fuse_stem``, with bn1's statistics summed by one reduction (cuDNN declines to sum them
    in the 3-channel convolution) and its normalise + ReLU as the other BNs' pass, or inside
    fasttrain's Triton max-pool where the model runs it (``affine_relu_max_pool2d``); in
    training, with ``how.stem_bn_in_pool``, the whole BN inside it (``bn_relu_max_pool2d``)."""
    if not how.fuse_stem:
        return model.maxpool(model.relu(model.bn1(_stem_conv(model.conv1, x, how))))
    y = _stem_conv(model.conv1, x, how)
    pool = model.maxpool
    # fasttrain's Triton max-pool (triton_maxpool): its module is loaded wherever one exists, and
    # importing it elsewhere would need Triton, which a CPU-only torch lacks
    triton_pool = sys.modules.get("fasttrain.kernels.maxpool")
    if how.mask_from_input and triton_pool and isinstance(pool, triton_pool.MaxPool2d):
        sizes = pool.kernel_size, pool.stride, pool.padding
        if how.stem_bn_in_pool and model.bn1.training and triton_pool.folds_bn(*sizes):
            return bn_relu_max_pool2d(y, model.bn1, *sizes, counted=how.count_once)
        return affine_relu_max_pool2d(y, *_bn(y, *sums(y), model.bn1, how), *sizes)
    return pool(_normalise_relu(y, _bn(y, *sums(y), model.bn1, how), how))


def _stem_conv(conv: nn.Conv2d, x: Tensor, how: Fusion) -> Tensor:
    """``conv(x)``; with ``how.pad_stem``, an image of fewer than ``STEM_CHANNELS`` channels and
    the weights are padded with zero channels up to it first. The zeros add nothing to the
    output, and the padded weights' gradient is the weights' own plus zeros that the padding's
    backward drops: the same values, from cuDNN's faster kernels (``STEM_CHANNELS``)."""
    missing = STEM_CHANNELS - x.shape[1]
    if not how.pad_stem or missing <= 0:
        return conv(x)
    w = F.pad(conv.weight, (0, 0, 0, 0, 0, missing))
    x = F.pad(x, (0, 0, 0, 0, 0, missing))
    return F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _identity(block: BasicBlock | Bottleneck, x: Tensor, how: Fusion) -> Tensor:
    if block.downsample is None:
        return x
    conv, bn = block.downsample[0], block.downsample[1]
    d, total, total_sq = _conv(x, conv, how=how)
    return affine(d, *_bn(d, total, total_sq, bn, how))


def _end(y: Tensor, prologue: Prologue, identity: Tensor, how: Fusion) -> Tensor:
    """A block's end: its last BN's normalise, the residual add and the ReLU, one pass."""
    if how.store_block_grad:
        return residual_relu(y, *prologue, identity, packed_mask=how.pack_block_mask)
    return torch.relu(affine(y, *prologue) + identity)


def _bottleneck(block: Bottleneck, x: Tensor, how: Fusion) -> Tensor:
    a1, t1, q1 = _conv(x, block.conv1, how=how)
    a2, t2, q2 = _conv(a1, block.conv2, _bn(a1, t1, q1, block.bn1, how), how=how)
    a3, t3, q3 = _conv(a2, block.conv3, _bn(a2, t2, q2, block.bn2, how), how=how)
    return _end(a3, _bn(a3, t3, q3, block.bn3, how), _identity(block, x, how), how)


def _basic(block: BasicBlock, x: Tensor, how: Fusion) -> Tensor:
    a1, t1, q1 = _conv(x, block.conv1, how=how)
    a2, t2, q2 = _conv(a1, block.conv2, _bn(a1, t1, q1, block.bn1, how), how=how)
    return _end(a2, _bn(a2, t2, q2, block.bn2, how), _identity(block, x, how), how)


class FusedResNet(torchvision.models.ResNet):
    """A torchvision ResNet whose forward folds each BatchNorm into the convolutions around it
    (module notes). ``arch`` is one of ``BLOCKS``; ``fold`` the kernel sizes of the convolutions
    that apply the previous BN and ReLU as they read (``FOLD``: none by default; ``ALL`` saves
    memory); the others read it from an elementwise pass, whose ReLU backward masks by the
    convolution output (``mask_from_input``, the default) or by the pass's output;
    ``store_block_grad`` stores each block end's masked gradient once; ``fuse_stem`` runs the
    stem's BN as the others, and ``stem_bn_in_pool`` inside the Triton pool; ``pad_stem`` pads
    the stem's image to ``STEM_CHANNELS`` channels; ``cast_once`` keeps each weight's cast for
    the backward; ``pack_block_mask`` keeps each block end's ReLU mask as bits;
    ``copy_affine`` saves copies of each normalise pass's scale and bias; ``count_once`` counts
    the batch in every BN at once (``Fusion``; all on by default but ``stem_bn_in_pool`` and
    ``copy_affine``, off for the references). The rest is ``ResNet``'s arguments."""

    def __init__(
        self,
        arch: str,
        fold: Collection[int] = FOLD,
        mask_from_input: bool = True,
        store_block_grad: bool = True,
        fuse_stem: bool = True,
        pad_stem: bool = True,
        cast_once: bool = True,
        stem_bn_in_pool: bool = False,
        pack_block_mask: bool = True,
        copy_affine: bool = False,
        count_once: bool = True,
        **kwargs,
    ):
        block, layers = BLOCKS[arch]
        super().__init__(block, layers, **kwargs)
        self.run_block = _bottleneck if block is Bottleneck else _basic
        self.fusion = Fusion(
            frozenset(fold),
            mask_from_input,
            store_block_grad,
            fuse_stem,
            pad_stem,
            cast_once,
            stem_bn_in_pool,
            pack_block_mask,
            copy_affine,
            count_once,
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.fusion.count_once:
            count_batches(self.finalized_bns())
        x = _stem(self, x, self.fusion)
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in layer:
                x = self.run_block(block, x, self.fusion)
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def finalized_bns(self) -> list[nn.BatchNorm2d]:
        """The BNs the forward runs through ``bn_finalize`` (the stem's only with
        ``fuse_stem``; otherwise ``nn.BatchNorm2d`` runs and counts it): those whose batch
        ``count_once`` counts."""
        bns = [self.bn1] if self.fusion.fuse_stem else []
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in layer:
                bns += [m for m in block.modules() if isinstance(m, nn.BatchNorm2d)]
        return bns
