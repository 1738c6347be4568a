"""2-D max-pooling, forward and backward, for ResNet's stem (3x3, stride 2, padding 1).

Why: in the compiled ResNet-50 step on an H200, inductor's max-pool of the stem took 1.8 ms per
step forward + backward (bench/stem.py), about 5% of the step, for about 0.7 GB of memory
traffic: its backward recomputes the forward's argmax from the input, window by window. Here the
forward keeps each output's argmax as an int8 offset in its window, and the backward gathers:
each input pixel checks the few windows that hold it and sums the gradients of those whose
argmax it is. Both work on tiles of pixels x channels, so channels_last reads and writes are
contiguous.

Registered as the custom ops ``fasttrain::max_pool2d`` and ``fasttrain::max_pool2d_backward``
(``torch.library``), so ``torch.compile`` calls them as single ops. ``F.max_pool2d`` is the
reference; the tests hold them together, ties and -inf included (the first maximum in a window
wins, as in torch, and NaN propagates). ``fasttrain::affine_relu_max_pool2d`` pools
``relu(x * scale + bias)`` per channel, applying the affine + ReLU as it reads ``x`` (the fused
path's stem, whose BN output is then never written), held to ``F.max_pool2d`` of the same.

ResNet's 3x3/2 pad-1 pool runs ``maxpool_rows``' kernels, which stream rows instead of gathering
windows (about twice as fast); the window kernels here run every other pool and are their
reference (``ROWS``). For that pool only (``folds_bn``),
``fasttrain::affine_relu_max_pool2d_picked`` also returns the input each output took, and
``fasttrain::affine_relu_max_pool2d_backward`` writes the gradient of the BN's input through the
affine + ReLU and the pool in one pass (``fasttrain.bn_pool.bn_relu_max_pool2d``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from . import maxpool_rows

# pixels, channels, warps of a program, forward and backward: the fastest of bench/test_kernels.py's
# sweep (bf16, 256 x 64 x 112 x 112)
TILE_FWD = (64, 64, 4)
TILE_BWD = (64, 64, 4)
# the forward that applies the affine + ReLU as it reads (the fused path's stem, fp16), whose
# arithmetic per value wants more warps: 0.40 ms against 0.59 with TILE_FWD on an H200, the fastest
# of eight tiles (those bench/test_kernels.py's test_affine_maxpool_forward times)
TILE_AFFINE_FWD = (32, 64, 8)
# the stem's 3x3/2 pad-1 pool runs maxpool_rows' kernels, which stream its rows; False runs the
# window kernels here for every pool (the reference the benchmarks time them against)
ROWS = True


@triton.jit
def _tile(P_TOTAL, C, A, B, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's tile: BLOCK_P pixels (n, a, b) of an N x A x B grid, flat, by BLOCK_C
    channels; their masks, and each pixel's n (int64, for the batch stride), a and b."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = (p // (A * B)).to(tl.int64)
    return p, c, p < P_TOTAL, c < C, n, (p // B) % A, p % B


@triton.jit
def _pool_fwd(
    x_ptr, out_ptr, off_ptr, scale_ptr, bias_ptr,
    P_TOTAL, C, H, W, OH, OW,
    sxn, sxc, sxh, sxw, son, soc, soh, sow,
    K: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, AFFINE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    p, c, p_ok, c_ok, n, oh, ow = _tile(P_TOTAL, C, OH, OW, BLOCK_P, BLOCK_C)  # output pixels
    if AFFINE:  # pool relu(x * scale + bias), each value rounded to x's dtype as torch stores it
        scale = tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    best = tl.full((BLOCK_P, BLOCK_C), -float("inf"), tl.float32)
    # torch starts from the window's first in-bounds position, so an all -inf window points there
    first = tl.maximum(PAD - oh * S, 0) * K + tl.maximum(PAD - ow * S, 0)
    arg = tl.zeros((BLOCK_P, BLOCK_C), tl.int32) + first[:, None]
    x_base = x_ptr + n * sxn
    for kh in tl.static_range(K):
        ih = oh * S - PAD + kh
        for kw in tl.static_range(K):
            iw = ow * S - PAD + kw
            ok = p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            ptr = x_base + ih.to(tl.int64) * sxh + iw * sxw
            v = tl.load(
                ptr[:, None] + c[None, :] * sxc,
                mask=ok[:, None] & c_ok[None, :],
                other=-float("inf"),
            ).to(tl.float32)
            if AFFINE:  # padding stays -inf; it is not a ReLU output of 0
                z = tl.where(ok[:, None] & c_ok[None, :], v, 0.0) * scale + bias
                z = tl.where(z < 0.0, 0.0, z).to(x_ptr.dtype.element_ty).to(tl.float32)
                v = tl.where(ok[:, None], z, -float("inf"))
            take = (v > best) | (v != v)  # as torch: a greater value, or NaN, takes over
            best = tl.where(take, v, best)
            arg = tl.where(take, kh * K + kw, arg)
    mask = p_ok[:, None] & c_ok[None, :]
    out = out_ptr + n * son + oh.to(tl.int64) * soh + ow * sow
    tl.store(out[:, None] + c[None, :] * soc, best.to(out_ptr.dtype.element_ty), mask=mask)
    off = off_ptr + p.to(tl.int64)[:, None] * C + c[None, :]
    tl.store(off, arg.to(tl.int8), mask=mask)


@triton.jit
def _pool_bwd(
    g_ptr, off_ptr, dx_ptr,
    P_TOTAL, C, H, W, OH, OW,
    sgn, sgc, sgh, sgw, sdn, sdc, sdh, sdw,
    K: tl.constexpr, S: tl.constexpr, PAD: tl.constexpr, CAND: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    _, c, p_ok, c_ok, n, ih, iw = _tile(P_TOTAL, C, H, W, BLOCK_P, BLOCK_C)  # input pixels
    acc = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
    # the windows holding (ih, iw): oh from (ih + PAD) // S down, at most CAND of them per axis
    for dh in tl.static_range(CAND):
        oh = (ih + PAD) // S - dh
        kh = ih + PAD - oh * S
        ok_h = (oh >= 0) & (oh < OH) & (kh < K)
        for dw in tl.static_range(CAND):
            ow = (iw + PAD) // S - dw
            kw = iw + PAD - ow * S
            ok = p_ok & ok_h & (ow >= 0) & (ow < OW) & (kw < K)
            m = ok[:, None] & c_ok[None, :]
            q = (n * OH + oh) * OW + ow  # the output pixel, flat
            o = tl.load(off_ptr + q[:, None] * C + c[None, :], mask=m, other=-1)
            g_row = g_ptr + n * sgn + oh.to(tl.int64) * sgh + ow * sgw
            g = tl.load(g_row[:, None] + c[None, :] * sgc, mask=m, other=0.0).to(tl.float32)
            acc += tl.where(o.to(tl.int32) == (kh * K + kw)[:, None], g, 0.0)
    dx = dx_ptr + n * sdn + ih.to(tl.int64) * sdh + iw * sdw
    tl.store(
        dx[:, None] + c[None, :] * sdc,
        acc.to(dx_ptr.dtype.element_ty),
        mask=p_ok[:, None] & c_ok[None, :],
    )


def _out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _like(x: torch.Tensor, shape: tuple[int, int, int, int], channels_last: bool) -> torch.Tensor:
    """An empty (N, C, H, W) tensor in channels_last or contiguous layout, as the input was."""
    n, c, h, w = shape
    if channels_last:
        return x.new_empty((n, h, w, c)).permute(0, 3, 1, 2)
    return x.new_empty(shape)


def _channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _pool_outputs(
    x: torch.Tensor, kernel: int, stride: int, padding: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's empty outputs: the pooled tensor in the input's layout, and the int8
    argmax offsets (N, OH, OW, C)."""
    n, c, h, w = x.shape
    oh, ow = _out_size(h, kernel, stride, padding), _out_size(w, kernel, stride, padding)
    out = _like(x, (n, c, oh, ow), _channels_last(x))
    return out, x.new_empty((n, oh, ow, c), dtype=torch.int8)


def _launch_fwd(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    kernel: int,
    stride: int,
    padding: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, c, h, w = x.shape
    out, offsets = _pool_outputs(x, kernel, stride, padding)
    if ROWS and maxpool_rows.applies(kernel, stride, padding):
        maxpool_rows.forward(x, out, offsets, scale, bias)
        return out, offsets
    oh, ow = out.shape[2:]
    affine = scale is not None
    bp, bc, warps = TILE_AFFINE_FWD if affine else TILE_FWD
    grid = (triton.cdiv(n * oh * ow, bp), triton.cdiv(c, bc))
    _pool_fwd[grid](
        x, out, offsets, scale if affine else x, bias if affine else x,
        n * oh * ow, c, h, w, oh, ow, *x.stride(), *out.stride(),
        K=kernel, S=stride, PAD=padding, AFFINE=affine, BLOCK_P=bp, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip
    return out, offsets


@torch.library.custom_op("fasttrain::max_pool2d", mutates_args=())
def _pool(
    x: torch.Tensor, kernel: int, stride: int, padding: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_fwd(x, None, None, kernel, stride, padding)


@_pool.register_fake
def _(x, kernel, stride, padding):
    return _pool_outputs(x, kernel, stride, padding)


@torch.library.custom_op("fasttrain::affine_relu_max_pool2d", mutates_args=())
def affine_relu_pool(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, kernel: int, stride: int, padding: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max_pool2d(relu(x * scale + bias))`` per channel and its argmax offsets, in one read of
    ``x``: the normalised activation is never written. No autograd formula of its own: the
    caller composes ``pool_backward`` with the affine + ReLU's backward
    (``fasttrain.conv_bn.affine_relu_max_pool2d``)."""
    return _launch_fwd(x, scale, bias, kernel, stride, padding)


@affine_relu_pool.register_fake
def _(x, scale, bias, kernel, stride, padding):
    return _pool_outputs(x, kernel, stride, padding)


def folds_bn(kernel: int, stride: int, padding: int) -> bool:
    """Whether ``affine_relu_pool_picked`` and ``affine_relu_pool_backward`` run this pool: the
    row kernels' (ResNet's stem), while they are on (``ROWS``)."""
    return ROWS and maxpool_rows.applies(kernel, stride, padding)


def _picked_outputs(x, kernel, stride, padding):
    out, offsets = _pool_outputs(x, kernel, stride, padding)
    return out, offsets, torch.empty_like(out)


@torch.library.custom_op("fasttrain::affine_relu_max_pool2d_picked", mutates_args=())
def affine_relu_pool_picked(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, kernel: int, stride: int, padding: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``affine_relu_pool`` and, in the output's shape, the input value each output took: what
    the BN's scale and bias gradients need (``sum(g * x)`` where the pre-activation is positive),
    read from the pooled side, a quarter of the input, instead of the input's gradient.
    Only where ``folds_bn``."""
    if not folds_bn(kernel, stride, padding):
        raise ValueError(f"affine_relu_pool_picked: no row kernel for pool {kernel}/{stride}")
    out, offsets, picked = _picked_outputs(x, kernel, stride, padding)
    maxpool_rows.forward(x, out, offsets, scale, bias, picked)
    return out, offsets, picked


@affine_relu_pool_picked.register_fake
def _(x, scale, bias, kernel, stride, padding):
    return _picked_outputs(x, kernel, stride, padding)


@torch.library.custom_op("fasttrain::affine_relu_max_pool2d_backward", mutates_args=())
def affine_relu_pool_backward(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    c0: torch.Tensor,
    c1: torch.Tensor,
    kernel: int,
    stride: int,
    padding: int,
) -> torch.Tensor:
    """The gradient of ``y`` through ``max_pool2d(relu(y * scale + bias))`` plus ``c0 + c1 * y``
    per channel (what a BN's statistics pass back to ``y``), in one pass that writes only it:
    the pool's gradient is never stored. In ``y``'s layout; only where ``folds_bn``."""
    if not folds_bn(kernel, stride, padding):
        raise ValueError(f"affine_relu_pool_backward: no row kernel for pool {kernel}/{stride}")
    dy = torch.empty_like(y)
    maxpool_rows.backward(grad, offsets, dy, (y, scale, bias, c0, c1))
    return dy


@affine_relu_pool_backward.register_fake
def _(grad, offsets, y, scale, bias, c0, c1, kernel, stride, padding):
    return torch.empty_like(y)


@torch.library.custom_op("fasttrain::max_pool2d_backward", mutates_args=())
def pool_backward(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    height: int,
    width: int,
    channels_last: bool,
    kernel: int,
    stride: int,
    padding: int,
) -> torch.Tensor:
    n, c, oh, ow = grad.shape
    dx = _like(grad, (n, c, height, width), channels_last)
    if ROWS and maxpool_rows.applies(kernel, stride, padding):
        maxpool_rows.backward(grad, offsets, dx)
        return dx
    bp, bc, warps = TILE_BWD
    grid = (triton.cdiv(n * height * width, bp), triton.cdiv(c, bc))
    _pool_bwd[grid](
        grad, offsets, dx, n * height * width, c, height, width, oh, ow,
        *grad.stride(), *dx.stride(),
        K=kernel, S=stride, PAD=padding, CAND=-(-kernel // stride),
        BLOCK_P=bp, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip
    return dx


@pool_backward.register_fake
def _(grad, offsets, height, width, channels_last, kernel, stride, padding):
    n, c = grad.shape[:2]
    return _like(grad, (n, c, height, width), channels_last)


def gather_grad(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    channels_last: bool,
    size: tuple[int, int],
    pool: tuple[int, int, int],
) -> torch.Tensor:
    """``pool_backward`` on ``grad`` (the input was ``size``, height by width, pooled by
    ``pool``: kernel, stride, padding) in the input's layout. Under ``torch.compile`` the gradient
    reaching the pool can arrive in the contiguous layout (inductor picks the layout of the add
    that sums it), where the kernel's channel loads are strided: about 0.6 against 0.34 ms on an
    H200 at ResNet-50's stem. Asked for here, in traced code, inductor writes it so where it is
    computed."""
    if channels_last:
        grad = grad.contiguous(memory_format=torch.channels_last)
    return pool_backward(grad, offsets, *size, channels_last, *pool)


def _setup(ctx, inputs, output):
    x, ctx.kernel, ctx.stride, ctx.padding = inputs
    ctx.height, ctx.width = x.shape[2:]
    ctx.channels_last = _channels_last(x)
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_out, grad_offsets):
    (offsets,) = ctx.saved_tensors
    size, pool = (ctx.height, ctx.width), (ctx.kernel, ctx.stride, ctx.padding)
    dx = gather_grad(grad_out, offsets, ctx.channels_last, size, pool)
    return dx, None, None, None


_pool.register_autograd(_backward, setup_context=_setup)


def max_pool2d(x: torch.Tensor, kernel: int, stride: int, padding: int) -> torch.Tensor:
    """``F.max_pool2d(x, kernel, stride, padding)`` (dilation 1, floor mode) by the kernels."""
    if padding > kernel // 2:
        raise ValueError(f"max_pool2d: padding {padding} is more than half the kernel {kernel}")
    return _pool(x, kernel, stride, padding)[0]


class MaxPool2d(nn.Module):
    """Drop-in for ``nn.MaxPool2d(kernel, stride, padding)`` running the Triton kernels."""

    def __init__(self, kernel_size: int, stride: int, padding: int = 0):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    @classmethod
    def replaces(cls, pool: nn.Module) -> bool:
        """Whether ``pool`` is an ``nn.MaxPool2d`` these kernels compute (square, dilation 1,
        floor mode, int sizes)."""
        if not isinstance(pool, nn.MaxPool2d) or pool.ceil_mode or pool.return_indices:
            return False
        sizes = (pool.kernel_size, pool.stride, pool.padding, pool.dilation)
        return all(isinstance(s, int) for s in sizes) and pool.dilation == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"
