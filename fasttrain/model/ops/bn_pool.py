"""ResNet's stem after its convolution: BatchNorm + ReLU + max-pool, in fasttrain's Triton pool.

The stem's 3-channel convolution cannot sum its BN's statistics (cuDNN declines it), so the
fused path sums them in one reduction and applies the normalise + ReLU inside the max-pool
(``affine_relu_max_pool2d``): the normalised activation is never written. Its backward is still
three passes over the full-size activation (112 x 112 x 64 per image): the pool's gradient
written, then inductor's reduction (the scale's and bias's gradients) and pointwise kernel
(the input's gradient, the statistics' share added) each reading it and the convolution output.

``bn_relu_max_pool2d`` takes the whole BN instead, so its backward knows every part of the
input's gradient:

- the scale's and bias's gradients are sums over the pool's *outputs*, a quarter of the input:
  each output's gradient goes to one input, so ``sum(g_in * y)`` is ``sum(g * y_picked)`` over
  the outputs, with ``y_picked`` the input each output took (saved by the forward, exact);
- from those, ``conv_bn.bn_finalize_backward`` gives the statistics' gradient, ``c0 + c1 * y``
  per channel;
- one kernel (``maxpool_rows``' backward with its BN epilogue) writes the input's gradient,
  pool, mask, scale and statistics together.

The same values and gradients as ``affine_relu_max_pool2d`` (up to the order of fp32 sums and
one fp16 rounding fewer), which stays the default: on an H200 this took less GPU time alone
(957 against 1,133 us) but made the step no faster (``FusedResNet(stem_bn_in_pool=...)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fasttrain.model.ops.conv_bn import (
    bn_finalize,
    bn_finalize_backward,
    kept,
    per_channel,
    prologue_backward,
    sums,
)
from fasttrain.model.ops.memory_format import memory_format_of


class _AffineReLUMaxPool(torch.autograd.Function):
    """``max_pool2d(relu(y * scale + bias))`` by fasttrain's Triton max-pool, which applies the
    affine + ReLU as it reads ``y``; the backward gathers the pool's gradient and masks it by
    the pre-activation recomputed from ``y``, as ``affine_relu``'s does."""

    @staticmethod
    def forward(ctx, y: Tensor, scale: Tensor, bias: Tensor, kernel: int, stride: int, pad: int):
        from fasttrain.kernels.maxpool import affine_relu_pool

        out, offsets = affine_relu_pool(y, scale, bias, kernel, stride, pad)
        ctx.save_for_backward(y, scale, bias, offsets)
        ctx.pool = kernel, stride, pad
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from fasttrain.kernels.maxpool import gather_grad

        y, scale, bias, offsets = ctx.saved_tensors
        channels_last = memory_format_of(y) == torch.channels_last
        ga = gather_grad(grad, offsets, channels_last, y.shape[2:], ctx.pool)
        return *prologue_backward(ga, y, scale, bias), None, None, None


def affine_relu_max_pool2d(
    y: Tensor, scale: Tensor, bias: Tensor, kernel: int, stride: int, padding: int
) -> Tensor:
    """``F.max_pool2d(affine_relu(y, scale, bias), kernel, stride, padding)`` in one Triton
    kernel that reads ``y`` once and never writes the normalised activation (the stem's BN +
    ReLU + max-pool); the same values and gradients. Scale and bias pass through ``kept`` for
    the reason ``affine_relu``'s do."""
    return _AffineReLUMaxPool.apply(y, *kept(scale, bias), kernel, stride, padding)


class _BNReLUMaxPool(torch.autograd.Function):
    """``max_pool2d(relu(y * scale + bias))`` where ``scale`` and ``bias`` are a BN's, from
    ``y``'s own statistics ``total`` and ``total_sq`` (given detached: this Function returns
    the whole of ``y``'s gradient, theirs included)."""

    @staticmethod
    def forward(
        ctx,
        y: Tensor,
        scale: Tensor,
        bias: Tensor,
        total: Tensor,
        total_sq: Tensor,
        eps: float,
        kernel: int,
        stride: int,
        pad: int,
    ) -> Tensor:
        from fasttrain.kernels.maxpool import affine_relu_pool_picked

        out, offsets, picked = affine_relu_pool_picked(y, scale, bias, kernel, stride, pad)
        ctx.save_for_backward(y, scale, bias, total, total_sq, offsets, picked)
        ctx.eps, ctx.pool = eps, (kernel, stride, pad)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from fasttrain.kernels.maxpool import affine_relu_pool_backward

        y, scale, bias, total, total_sq, offsets, picked = ctx.saved_tensors
        # the scale's and bias's gradients from the pooled side: each output's gradient reaches
        # the input it took, masked by that input's pre-activation
        wide = picked.to(scale.dtype)
        live = grad.to(scale.dtype) * (wide * per_channel(scale) + per_channel(bias) > 0)
        grad_scale, grad_bias = (live * wide).sum((0, 2, 3)), live.sum((0, 2, 3))
        count = y.shape[0] * y.shape[2] * y.shape[3]
        c0, grad_sq = bn_finalize_backward(
            grad_scale, grad_bias, total, total_sq, count, scale, ctx.eps
        )
        # the kernel's loads are coalesced in y's layout (maxpool.gather_grad)
        grad = grad.contiguous(memory_format=memory_format_of(y))
        gy = affine_relu_pool_backward(grad, offsets, y, scale, bias, c0, 2 * grad_sq, *ctx.pool)
        return gy, grad_scale, grad_bias, None, None, None, None, None, None


def bn_relu_max_pool2d(
    y: Tensor,
    bn: torch.nn.modules.batchnorm._BatchNorm,
    kernel: int,
    stride: int,
    padding: int,
    *,
    counted: bool = False,
) -> Tensor:
    """``F.max_pool2d(relu(bn(y)), kernel, stride, padding)`` with ``bn`` in training (its
    running statistics updated as ``nn.BatchNorm2d`` does; ``counted``: the batch is already
    counted, ``conv_bn.count_batches``), its backward one pass that writes
    only ``y``'s gradient (module notes). The caller checks that fasttrain's pool folds it
    (``kernels.maxpool.folds_bn``); in eval mode, or elsewhere, ``affine_relu_max_pool2d`` of
    ``bn_finalize``'s scale and bias computes the same."""
    if not bn.training:
        raise ValueError("bn_relu_max_pool2d: the BN must be in training mode")
    total, total_sq = sums(y.detach())
    count = y.shape[0] * y.shape[2] * y.shape[3]
    scale, bias = kept(*bn_finalize(total, total_sq, count, bn, counted=counted))
    return _BNReLUMaxPool.apply(y, scale, bias, total, total_sq, bn.eps, kernel, stride, padding)
