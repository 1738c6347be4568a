"""Convolution with BatchNorm folded in: the ops of the fused model path, and their reference.

A BatchNorm after a convolution reads the convolution's output twice (statistics, then
normalise), and the ReLU after it once more. Folded into the convolutions, nothing is re-read:

- ``conv_bn(x, w, scale, bias)`` convolves ``relu(x * scale + bias)`` (the *previous* BN's
  normalise and ReLU, applied as the input is read: a prologue) and returns, beside the output,
  its per-channel sum and sum of squares in fp32 (fp64 for fp64 inputs): the *next* BN's
  statistics, computed as the output is written (an epilogue). Without ``scale`` the input is
  taken as it is.
- ``bn_finalize`` turns those sums into the next prologue's scale and bias, and updates the
  running statistics exactly as ``nn.BatchNorm2d`` does (momentum, unbiased running variance);
  ``count_batches`` counts the batch for many BNs at once, one kernel rather than one each.
- ``affine_relu`` applies a BN's normalise + ReLU as an elementwise pass (where it is not
  folded), with a backward that masks by the pass's input rather than its output.
- ``residual_relu`` ends a residual block (normalise, add, ReLU) with a backward whose masked
  gradient is stored once rather than recomputed by each of its readers.
- ``cast_weight`` casts a convolution's fp32 weight to the activations' dtype once per step and
  keeps the cast for the backward, which would otherwise cast it again.

``conv_bn`` is a custom op (``fasttrain::conv_bn``) with a fake implementation, so
``torch.compile`` traces through it and a CUDA graph captures it. Its kernel is the plain-PyTorch
reference of the decomposition (``reference``), except on CUDA: cuDNN's fused forward where it
runs (``cudnn_conv_bn``, fp16), held to the reference by the GPU tests. Its backward
(``backward``, the autograd formula) is ordinary torch ops on every device, so inductor fuses
it: cuDNN's fused backward patterns, measured per layer, lost to a bare dgrad beside inductor's
kernels everywhere, and won for wgrad only where a prologue must be recomputed, which the default
model does not fold (docs/DESIGN.md).

Gradients: with ``g`` the gradient of the output plus the sums' gradients (``gsum`` per channel,
``2 y gsumsq``), the convolution's dgrad and wgrad take ``g``, and the prologue's backward masks
by the recomputed pre-activation (``x * scale + bias > 0``): ``gx = g_in * scale``,
``gscale = sum(g_in * x)``, ``gbias = sum(g_in)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from fasttrain.model.ops.memory_format import memory_format_of
from fasttrain.model.ops.signs import PACK, relu_and_signs, unpack_signs


def per_channel(v: Tensor) -> Tensor:
    """A per-channel vector shaped to broadcast over (N, C, H, W)."""
    return v.view(1, -1, 1, 1)


def _acc(x: Tensor) -> torch.dtype:
    """What the sums and the prologue compute in: fp32, or fp64 for fp64 inputs (tests)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _prologue(x: Tensor, scale: Tensor | None, bias: Tensor | None) -> Tensor:
    """``relu(x * scale + bias)`` in fp32, stored in ``x``'s dtype; ``x`` without a scale."""
    if scale is None:
        return x
    out = torch.relu(x.to(_acc(x)) * per_channel(scale) + per_channel(bias))
    # not out.to(x.dtype) when the dtypes match: that returns ``out`` itself, and torch 2.11's
    # dynamo then zeroes the input gradient of the autograd.Function (``_AffineReLU``) whose
    # forward returns it; fp32 and fp64 models (the tests, CPU runs) lost that gradient
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def sums(y: Tensor) -> tuple[Tensor, Tensor]:
    """``y``'s per-channel sum and sum of squares, in fp32 (fp64 for fp64): a BN's statistics as
    ``bn_finalize`` takes them."""
    wide = y.to(_acc(y))
    return wide.sum((0, 2, 3)), (wide * wide).sum((0, 2, 3))


def reference(
    x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, stride: int, padding: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``conv_bn`` in plain PyTorch: the kernel on every device, and what a fused one is held to."""
    a = _prologue(x, scale, bias)
    y = F.conv2d(a, weight.to(x.dtype), stride=stride, padding=padding)
    y = y.contiguous(memory_format=memory_format_of(x))
    return y, *sums(y)


@torch.library.custom_op("fasttrain::conv_bn", mutates_args=())
def conv_bn(
    x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None, stride: int, padding: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, sum, sum of squares): ``y = conv2d(prologue(x), weight)`` in ``x``'s dtype, the sums
    per output channel over batch and space in fp32 (module notes)."""
    return reference(x, weight, scale, bias, stride, padding)


@conv_bn.register_kernel("cuda")
def _(x, weight, scale, bias, stride, padding):
    """cuDNN's fused kernel where it runs (fp16, channels_last, the frontend installed), else
    the reference."""
    from fasttrain.model.cudnn import conv_bn as cudnn_conv_bn

    fused = cudnn_conv_bn.forward(x, weight, scale, bias, stride, padding)
    return fused if fused is not None else reference(x, weight, scale, bias, stride, padding)


@conv_bn.register_fake
def _(x, weight, scale, bias, stride, padding):
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    shape = (n, k, _out_size(h, r, stride, padding), _out_size(w, s, stride, padding))
    y = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format_of(x))
    return y, x.new_empty((k,), dtype=_acc(x)), x.new_empty((k,), dtype=_acc(x))


def backward(
    grad_y: Tensor,
    grad_sum: Tensor,
    grad_sumsq: Tensor,
    y: Tensor,
    x: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    bias: Tensor | None,
    stride: int,
    padding: int,
    input_grad: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor | None]:
    """Gradients of ``conv_bn`` for (x, weight, scale, bias) in ordinary torch ops (module
    notes): ``torch.compile`` traces them into the backward graph, where inductor fuses the
    elementwise work and the reductions with their neighbours (the gradient of the next layer's
    input included) and calls cuDNN for the convolution's dgrad and wgrad. Without a prologue,
    scale's and bias's are None; without ``input_grad``, x's."""
    acc = _acc(x)
    g = grad_y.to(acc) + per_channel(grad_sum) + 2 * y.to(acc) * per_channel(grad_sumsq)
    g = g.to(y.dtype)
    a = _prologue(x, scale, bias)
    ga, gw, _ = torch.ops.aten.convolution_backward(
        g,
        a,
        weight.to(x.dtype),
        None,
        [stride, stride],
        [padding, padding],
        [1, 1],
        False,
        [0, 0],
        1,
        [input_grad or scale is not None, True, False],
    )
    gw = gw.to(weight.dtype)
    if scale is None:
        return (
            (ga.contiguous(memory_format=memory_format_of(x)) if input_grad else None),
            gw,
            None,
            None,
        )
    gx, gscale, gbias = prologue_backward(ga, x, scale, bias)
    return (gx if input_grad else None), gw, gscale, gbias


def prologue_backward(
    ga: Tensor, x: Tensor, scale: Tensor, bias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``relu(x * scale + bias)`` for (x, scale, bias) from its output's ``ga``,
    the ReLU masked by the pre-activation recomputed from ``x``."""
    wide = x.to(_acc(x))
    gz = ga.to(wide.dtype) * (wide * per_channel(scale) + per_channel(bias) > 0)
    gx = (gz * per_channel(scale)).to(x.dtype).contiguous(memory_format=memory_format_of(x))
    return gx, (gz * wide).sum((0, 2, 3)), gz.sum((0, 2, 3))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, scale, bias, stride, padding = inputs
    ctx.save_for_backward(x, weight, scale, bias, output[0])
    ctx.stride, ctx.padding = stride, padding


def _backward(ctx, grad_y, grad_sum, grad_sumsq):
    x, weight, scale, bias, y = ctx.saved_tensors
    k = weight.shape[0]
    zeros = y.new_zeros((k,), dtype=_acc(x))
    gx, gw, gscale, gbias = backward(
        torch.zeros_like(y) if grad_y is None else grad_y,
        zeros if grad_sum is None else grad_sum,
        zeros if grad_sumsq is None else grad_sumsq,
        y,
        x,
        weight,
        scale,
        bias,
        ctx.stride,
        ctx.padding,
        input_grad=ctx.needs_input_grad[0],
    )
    return gx, gw, gscale, gbias, None, None


conv_bn.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("fasttrain::cast_weight", mutates_args=())
def cast_weight(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """``weight`` in ``dtype`` (the activations'), cast once in the forward and saved for the
    backward. ``conv_bn`` casts an fp32 weight itself, and the compiled backward then casts it
    again for dgrad: AOTAutograd's partitioner recomputes a cast of a parameter, which it has for
    free, rather than save the result. A custom op's output is saved (``kept``), so each weight
    is cast once per step instead of twice (52 small kernels fewer per ResNet-50 step, for
    ResNet-50's 47 MB of fp16 weights kept until the backward). Its gradient is the incoming one
    cast back to the weight's dtype, as the cast's own."""
    return weight.to(dtype, copy=True)  # a custom op's output may not alias its input


@cast_weight.register_fake
def _(weight, dtype):
    return torch.empty_like(weight, dtype=dtype)


def _cast_weight_context(ctx, inputs, output) -> None:
    ctx.weight_dtype = inputs[0].dtype


cast_weight.register_autograd(
    lambda ctx, grad: (grad.to(ctx.weight_dtype), None), setup_context=_cast_weight_context
)


def bn_finalize(
    total: Tensor,
    total_sq: Tensor,
    count: int,
    bn: torch.nn.modules.batchnorm._BatchNorm,
    *,
    counted: bool = False,
) -> tuple[Tensor, Tensor]:
    """``bn``'s scale and bias for the next prologue, per channel in fp32: from a batch's sums
    (``count`` values per channel) in training, updating ``bn``'s running statistics as
    ``nn.BatchNorm2d`` does (``counted``: the batch is already counted, ``count_batches``);
    from the running statistics in eval mode."""
    acc = total.dtype
    gamma, beta = bn.weight.to(acc), bn.bias.to(acc)
    if not bn.training:
        scale = gamma * torch.rsqrt(bn.running_var.to(acc) + bn.eps)
        return scale, beta - bn.running_mean.to(acc) * scale
    mean = total / count
    var = at_least_zero(total_sq / count - mean * mean)  # biased: what normalises the batch
    scale = gamma * torch.rsqrt(var + bn.eps)
    update_running_stats(bn, mean, var, count, counted=counted)
    return scale, beta - mean * scale


def bn_finalize_backward(
    grad_scale: Tensor,
    grad_bias: Tensor,
    total: Tensor,
    total_sq: Tensor,
    count: int,
    scale: Tensor,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """The gradients of ``total`` and ``total_sq`` through ``bn_finalize`` in training, from
    those of the ``scale`` and ``bias`` it returned: what autograd computes from its formula
    (the variance's clamp included), for a kernel that adds them into the input's gradient
    itself (``bn_pool.bn_relu_max_pool2d``)."""
    mean = total / count
    var = total_sq / count - mean * mean
    # scale = gamma * rsqrt(var + eps), bias = beta - mean * scale
    reaches_scale = grad_scale - mean * grad_bias
    grad_var = -0.5 * reaches_scale * scale / (at_least_zero(var) + eps)
    grad_var = torch.where(var > 0, grad_var, 0)  # as ``at_least_zero``: none at 0 or below
    grad_mean = -scale * grad_bias - 2 * mean * grad_var
    return grad_mean / count, grad_var / count


def at_least_zero(var: Tensor) -> Tensor:
    """``var`` clamped up to 0 (E[x²] − E[x]² can come out just below it), with no gradient at 0
    or below, on every torch: ``clamp_min(0)``'s gradient at exactly 0 (a constant channel)
    differs between versions (2.11 passes it, 2.14 does not). A NaN stays a NaN."""
    return torch.where(var > 0, var, var * 0)


def update_running_stats(
    bn: torch.nn.modules.batchnorm._BatchNorm,
    mean: Tensor,
    var: Tensor,
    count: int,
    *,
    counted: bool = False,
) -> None:
    """Fold one batch's mean and biased variance (``count`` values per channel) into ``bn``'s
    running statistics exactly as ``nn.BatchNorm2d`` does: momentum (None: a cumulative
    average), the running variance unbiased, ``num_batches_tracked`` counted, unless
    ``counted`` (``count_batches`` counted it already)."""
    with torch.no_grad():
        if not counted:
            bn.num_batches_tracked.add_(1)
        factor = 1.0 / bn.num_batches_tracked if bn.momentum is None else bn.momentum
        bn.running_mean.mul_(1 - factor).add_(factor * mean.detach())
        unbiased = var.detach() * (count / max(count - 1, 1))
        bn.running_var.mul_(1 - factor).add_(factor * unbiased)


def count_batches(bns: Iterable[torch.nn.modules.batchnorm._BatchNorm]) -> None:
    """Count one batch in the ``num_batches_tracked`` of each of ``bns`` in training, as its own
    forward would, with one multi-tensor add. Compiled, that is one kernel for all of them,
    where each BN counting its own batch is a one-element kernel per BN (53 in ResNet-50's
    step): inductor fuses no kernel of one element with its BN's per-channel kernels, but
    groups a ``_foreach`` op's tensors into one. Each BN's ``bn_finalize`` is then called with
    ``counted``, before which the count must come (momentum None reads it)."""
    counters = [
        bn.num_batches_tracked
        for bn in bns
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None
    ]
    if counters:
        with torch.no_grad():
            torch._foreach_add_(counters, 1)


@torch.library.custom_op("fasttrain::kept", mutates_args=())
def kept(scale: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Copies of a BN's per-channel scale and bias that the compiled backward reads as saved
    tensors: AOTAutograd's partitioner recomputes ordinary per-channel arithmetic in the
    backward instead of saving it, but not a custom op's output, which is not on its list of
    recomputable ops (``affine_relu``)."""
    return scale.clone(), bias.clone()


@kept.register_fake
def _(scale, bias):
    return torch.empty_like(scale), torch.empty_like(bias)


kept.register_autograd(lambda ctx, g_scale, g_bias: (g_scale, g_bias))


class _AffineReLU(torch.autograd.Function):
    """``relu(y * scale + bias)`` whose backward masks by the pre-activation recomputed from
    ``y`` (kept for ``conv_bn``'s backward anyway) instead of reading the output."""

    @staticmethod
    def forward(ctx, y: Tensor, scale: Tensor, bias: Tensor, mark: bool = False) -> Tensor:
        if mark:  # the partitioner saves them (``stored``) rather than recomputing them
            scale, bias = stored(scale), stored(bias)
        ctx.save_for_backward(y, scale, bias)
        return _prologue(y, scale, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (*prologue_backward(grad, *ctx.saved_tensors), None)


def affine_relu(y: Tensor, scale: Tensor, bias: Tensor, *, copy_affine: bool = False) -> Tensor:
    """``relu(y * scale + bias)`` per channel, as ``torch.relu(affine(...))`` computes it, with a
    backward that reads one activation fewer: torch.relu's backward masks by reading the ReLU's
    output; this one recomputes the mask from ``y``, which the BN's two backward kernels (its
    sums, its input gradient) read anyway. That holds only while the masked gradient is
    recomputed inside both kernels: inductor stores a reused expression that reads more than
    four tensors as a buffer of its own (more traffic, not less), so the scale and bias are
    read as two saved tensors rather than rebuilt from the BN's statistics there: the tensors
    themselves marked ``stored`` (no copy kernels), or with ``copy_affine`` copies (``kept``).
    ``bench/traffic.py`` counts the difference."""
    if copy_affine:
        return _AffineReLU.apply(y, *kept(scale, bias))
    return _AffineReLU.apply(y, scale, bias, True)


def stored(t: Tensor) -> Tensor:
    """``t``, which inductor writes to a buffer of its own where it is computed, rather than
    recomputing it inside every kernel that reads it (its rule for an expression of at most
    four inputs): no copy (``prims.inductor_force_stride_order`` with ``t``'s own strides,
    inductor's own hint); outside a compiled graph, ``t`` itself (the prim's eager form would
    copy it)."""
    from torch._subclasses.fake_tensor import is_fake

    if not (torch.compiler.is_compiling() or is_fake(t)):  # traced by dynamo or AOTAutograd
        return t
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(t, t.stride())


class _ResidualReLU(torch.autograd.Function):
    """``relu(affine(y, scale, bias) + identity)`` whose backward stores the masked gradient
    once (``stored``) for its three readers: the BN's sums, its input gradient, and the block
    input's gradient (the identity)."""

    @staticmethod
    def forward(ctx, y: Tensor, scale: Tensor, bias: Tensor, identity: Tensor) -> Tensor:
        out = torch.relu(affine(y, scale, bias) + identity)
        ctx.save_for_backward(y, scale, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y, scale, out = ctx.saved_tensors
        masked = stored(torch.where(out > 0, grad, 0))
        wide = masked.to(scale.dtype)
        gy = (wide * per_channel(scale)).to(y.dtype).contiguous(memory_format=memory_format_of(y))
        return gy, (wide * y.to(scale.dtype)).sum((0, 2, 3)), wide.sum((0, 2, 3)), masked


class _PackedResidualReLU(torch.autograd.Function):
    """``_ResidualReLU`` that keeps the ReLU's mask as bits (``pack_signs``) instead of the
    output itself: its backward reads one bit per element where it read two bytes."""

    @staticmethod
    def forward(ctx, y: Tensor, scale: Tensor, bias: Tensor, identity: Tensor) -> Tensor:
        out, signs = relu_and_signs(affine(y, scale, bias) + identity)
        ctx.save_for_backward(y, scale, signs)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        y, scale, signs = ctx.saved_tensors
        masked = stored(torch.where(unpack_signs(signs, grad.shape), grad, 0))
        wide = masked.to(scale.dtype)
        gy = (wide * per_channel(scale)).to(y.dtype).contiguous(memory_format=memory_format_of(y))
        return gy, (wide * y.to(scale.dtype)).sum((0, 2, 3)), wide.sum((0, 2, 3)), masked


def residual_relu(
    y: Tensor, scale: Tensor, bias: Tensor, identity: Tensor, packed_mask: bool = False
) -> Tensor:
    """A residual block's end, ``relu(affine(y, scale, bias) + identity)``, as torch.relu and
    ``affine`` compute it, with the same gradients. The masked gradient has three readers; as an
    expression of three activations (the ReLU's output and the gradient's two parts, the next
    block's dgrad and identity) inductor would recompute it inside each of them, three reads
    where one stored buffer costs a write and a read. ``stored`` makes it that buffer. With
    ``packed_mask`` (and channels a multiple of ``PACK``), the backward reads the ReLU's mask
    from one bit per element (``pack_signs``, written with the output) rather than from the
    output: of the four passes of that kernel, one becomes a sixteenth."""
    if packed_mask and y.shape[1] % PACK == 0:
        return _PackedResidualReLU.apply(y, scale, bias, identity)
    return _ResidualReLU.apply(y, scale, bias, identity)


def affine(y: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """``y * scale + bias`` per channel in fp32, stored in ``y``'s dtype: a BN's normalise where
    no convolution follows to fold it into."""
    return (y.to(scale.dtype) * per_channel(scale) + per_channel(bias)).to(y.dtype)
