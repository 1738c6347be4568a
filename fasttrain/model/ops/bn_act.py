"""BatchNorm with the residual add and the ReLU after it, as one op: the ``--cudnn-bn`` model
path, which runs cuDNN's standalone fused BatchNorm kernels, and its plain-PyTorch reference.

In torchvision's ResNet each BatchNorm is followed by a ReLU, by the residual add and a ReLU (the
block's last), or by nothing (the downsample branch). ``bn_act(x, weight, bias, residual, eps,
relu)`` computes ``relu(batch_norm(x) + residual)`` from the batch's statistics and returns,
beside the output, the batch mean and inverse standard deviation (for the backward and the
running statistics) and, with ``relu``, where the output is positive as a bit mask: one bit per
value, channel c in bit c % 8 of byte c // 8, NHWC (the layout cuDNN writes). The backward then
needs one bit per value instead of the output. ``bn_act_backward`` is the gradient: dReLU, the
residual's gradient (dAdd) and BN's backward, in one op.

Both are custom ops (``fasttrain::bn_act``, ``fasttrain::bn_act_backward``) with fake
implementations, so ``torch.compile`` traces through them and a CUDA graph captures them. Their
kernels are the references here (``reference``, ``backward_reference``) on every device, except on
CUDA where cuDNN's kernels run (``cudnn_bn``: bf16 and fp16, NHWC), held to the references by the
GPU tests. Unlike ``--fused-bn`` this removes no pass over the activations: it changes which
kernels make them (cuDNN's instead of inductor's), which is why it is measured in the step.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from fasttrain.model.ops.conv_bn import affine, per_channel, update_running_stats
from fasttrain.model.ops.memory_format import memory_format_of


def _acc(x: Tensor) -> torch.dtype:
    """What the statistics are computed in: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mask_shape(x: Tensor) -> tuple[int, int, int, int]:
    n, c, h, w = x.shape
    return n, -(-c // 8), h, w


def pack_mask(positive: Tensor) -> Tensor:
    """A bool (N, C, H, W) tensor as bits: uint8 (N, ceil(C / 8), H, W), channels_last, channel
    c in bit c % 8 of byte c // 8 (cuDNN's layout)."""
    n, c, h, w = positive.shape
    groups = -(-c // 8)
    bits = positive.permute(0, 2, 3, 1).to(torch.uint8)
    if c % 8:
        bits = torch.nn.functional.pad(bits, (0, groups * 8 - c))
    shifts = torch.arange(8, device=positive.device, dtype=torch.uint8)
    packed = (bits.reshape(n, h, w, groups, 8) << shifts).sum(-1, dtype=torch.uint8)
    return packed.permute(0, 3, 1, 2)


def unpack_mask(packed: Tensor, channels: int) -> Tensor:
    """``pack_mask``'s inverse: bool (N, channels, H, W)."""
    n, groups, h, w = packed.shape
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed.permute(0, 2, 3, 1).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(n, h, w, groups * 8)[..., :channels].permute(0, 3, 1, 2).bool()


def reference(
    x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None, eps: float, relu: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``bn_act`` in plain PyTorch: the kernel on every device, and what cuDNN's is held to."""
    acc = _acc(x)
    wide = x.to(acc)
    var, mean = torch.var_mean(wide, dim=(0, 2, 3), correction=0)
    invstd = torch.rsqrt(var + eps)
    y = (wide - per_channel(mean)) * per_channel(invstd * weight.to(acc))
    y = y + per_channel(bias.to(acc))
    if residual is not None:
        y = y + residual.to(acc)
    y = y.to(x.dtype).contiguous(memory_format=memory_format_of(x))
    mask = x.new_empty((0,), dtype=torch.uint8)
    if relu:
        y = torch.relu(y)
        mask = pack_mask(y > 0)
    return y, mask, mean, invstd


@torch.library.custom_op("fasttrain::bn_act", mutates_args=())
def bn_act(
    x: Tensor, weight: Tensor, bias: Tensor, residual: Tensor | None, eps: float, relu: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, mask, mean, invstd): ``y = relu(batch_norm(x) + residual)`` over the batch's
    statistics, in ``x``'s dtype; the ReLU's bit mask (empty without ``relu``); the batch mean
    and inverse standard deviation per channel in fp32 (module notes)."""
    return reference(x, weight, bias, residual, eps, relu)


@bn_act.register_kernel("cuda")
def _(x, weight, bias, residual, eps, relu):
    """cuDNN's fused BN kernels where they run (bf16 or fp16, channels_last, the frontend
    installed), else the reference."""
    from fasttrain.model.cudnn import bn as cudnn_bn

    fused = cudnn_bn.forward(x, weight, bias, residual, eps, relu)
    return fused if fused is not None else reference(x, weight, bias, residual, eps, relu)


@bn_act.register_fake
def _(x, weight, bias, residual, eps, relu):
    c = x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=memory_format_of(x))
    mask = x.new_empty((0,), dtype=torch.uint8)
    if relu:
        mask = torch.empty(
            _mask_shape(x), dtype=torch.uint8, device=x.device, memory_format=torch.channels_last
        )
    return y, mask, x.new_empty((c,), dtype=_acc(x)), x.new_empty((c,), dtype=_acc(x))


def backward_reference(
    grad_y: Tensor,
    x: Tensor,
    mask: Tensor,
    weight: Tensor,
    mean: Tensor,
    invstd: Tensor,
    relu: bool,
    residual: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``bn_act_backward`` in plain PyTorch."""
    acc = _acc(x)
    g = grad_y.to(acc)
    if relu:
        g = g * unpack_mask(mask, x.shape[1])
    fmt = memory_format_of(x)
    grad_residual = x.new_empty((0,))
    if residual:
        grad_residual = g.to(grad_y.dtype).contiguous(memory_format=fmt)
    xhat = (x.to(acc) - per_channel(mean)) * per_channel(invstd)
    grad_bias = g.sum((0, 2, 3))
    grad_weight = (g * xhat).sum((0, 2, 3))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    gx = per_channel(weight.to(acc) * invstd) * (
        g - per_channel(grad_bias / count) - xhat * per_channel(grad_weight / count)
    )
    return (
        gx.to(x.dtype).contiguous(memory_format=fmt),
        grad_weight.to(weight.dtype),
        grad_bias.to(weight.dtype),
        grad_residual,
    )


@torch.library.custom_op("fasttrain::bn_act_backward", mutates_args=())
def bn_act_backward(
    grad_y: Tensor,
    x: Tensor,
    mask: Tensor,
    weight: Tensor,
    mean: Tensor,
    invstd: Tensor,
    relu: bool,
    residual: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad x, grad weight, grad bias, grad residual) of ``bn_act`` (the last empty without a
    residual)."""
    return backward_reference(grad_y, x, mask, weight, mean, invstd, relu, residual)


@bn_act_backward.register_kernel("cuda")
def _(grad_y, x, mask, weight, mean, invstd, relu, residual):
    from fasttrain.model.cudnn import bn as cudnn_bn

    fused = cudnn_bn.backward(grad_y, x, mask, weight, mean, invstd, relu, residual)
    if fused is not None:
        return fused
    return backward_reference(grad_y, x, mask, weight, mean, invstd, relu, residual)


@bn_act_backward.register_fake
def _(grad_y, x, mask, weight, mean, invstd, relu, residual):
    fmt = memory_format_of(x)
    gx = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    grad_residual = x.new_empty((0,))
    if residual:
        grad_residual = torch.empty(x.shape, dtype=grad_y.dtype, device=x.device, memory_format=fmt)
    return gx, torch.empty_like(weight), torch.empty_like(weight), grad_residual


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _, residual, _, relu = inputs
    _, mask, mean, invstd = output
    ctx.save_for_backward(x, mask, weight, mean, invstd)
    ctx.relu, ctx.residual = relu, residual is not None


def _backward(ctx, grad_y, _grad_mask, _grad_mean, _grad_invstd):
    """The mean and invstd feed the running statistics only (``batch_norm_act`` detaches them):
    no gradient flows back through them."""
    x, mask, weight, mean, invstd = ctx.saved_tensors
    gx, gw, gb, gr = bn_act_backward(grad_y, x, mask, weight, mean, invstd, ctx.relu, ctx.residual)
    return gx, gw, gb, (gr if ctx.residual else None), None, None


bn_act.register_autograd(_backward, setup_context=_setup_context)


def batch_norm_act(
    x: Tensor, bn: _BatchNorm, residual: Tensor | None = None, relu: bool = True
) -> Tensor:
    """``relu(bn(x) + residual)`` (without ``relu``: ``bn(x) + residual``) as ``nn.BatchNorm2d``
    computes it: in training from the batch through ``bn_act``, updating ``bn``'s running
    statistics; in eval mode from the running statistics, as ordinary torch ops that inductor
    fuses with their neighbours."""
    if bn.weight is None or bn.bias is None:
        raise ValueError("batch_norm_act needs a BatchNorm with affine=True")
    if bn.training or bn.running_mean is None:
        y, _, mean, invstd = bn_act(x, bn.weight, bn.bias, residual, bn.eps, relu)
        if bn.training and bn.running_mean is not None:
            mean, invstd = mean.detach(), invstd.detach()
            var = (1.0 / (invstd * invstd) - bn.eps).clamp_min(0)
            update_running_stats(bn, mean, var, x.shape[0] * x.shape[2] * x.shape[3])
        return y
    acc = _acc(x)
    scale = bn.weight.to(acc) * torch.rsqrt(bn.running_var.to(acc) + bn.eps)
    y = affine(x, scale, bn.bias.to(acc) - bn.running_mean.to(acc) * scale)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if relu else y
