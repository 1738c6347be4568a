"""Normalize: uint8 NHWC images in, normalised bf16/fp16 out as channels_last NCHW, with an
optional horizontal flip per sample, in one pass (read 1 byte, write 2 per value).

The torchvision loader path ships uint8 to the GPU; this replaces its float conversion, subtract,
multiply and cast (four passes over the batch) with one. ``normalize_reference`` is the plain torch
version the tests hold it to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def normalize_reference(
    images: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    flip: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``images`` uint8 (N, H, W, C); ``mean``/``std`` per channel in 0-255 units; ``flip`` bool
    (N,). Returns (N, C, H, W) in ``dtype``, channels_last."""
    x = images
    if flip is not None:
        x = torch.where(flip[:, None, None, None], x.flip(2), x)
    x = (x.float() - mean.float()) * (1.0 / std.float())  # as the torchvision loader does
    return x.to(dtype).permute(0, 3, 1, 2)  # NHWC storage seen as NCHW: channels_last


@triton.jit
def _normalize_kernel(
    x_ptr,
    out_ptr,
    mean_ptr,
    inv_std_ptr,
    flip_ptr,
    total,
    H,
    W,
    C: tl.constexpr,
    HAS_FLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    c = offs % C
    pixel = offs // C
    w = pixel % W
    nh = pixel // W  # n * H + h
    src = offs
    if HAS_FLIP:
        n = nh // H
        f = tl.load(flip_ptr + n, mask=mask, other=0)
        src = tl.where(f != 0, (nh * W + (W - 1 - w)) * C + c, offs)
    x = tl.load(x_ptr + src, mask=mask, other=0).to(tl.float32)
    m = tl.load(mean_ptr + c, mask=mask, other=0.0)
    s = tl.load(inv_std_ptr + c, mask=mask, other=1.0)
    y = (x - m) * s
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def normalize(
    images: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    flip: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block: int = 1024,
) -> torch.Tensor:
    """The Triton kernel behind ``normalize_reference``'s signature; ``out`` (channels_last NCHW,
    ``dtype``) is filled in place if given, which a CUDA graph or a fixed buffer wants."""
    if images.dtype != torch.uint8 or images.dim() != 4 or not images.is_contiguous():
        raise ValueError("normalize: expected contiguous uint8 NHWC images")
    n, h, w, c = images.shape
    if out is None:
        out = torch.empty((n, h, w, c), dtype=dtype, device=images.device).permute(0, 3, 1, 2)
    inv_std = (1.0 / std.float()).contiguous()
    flip_arg = flip.to(torch.uint8) if flip is not None else images  # unused without HAS_FLIP
    total = images.numel()
    _normalize_kernel[(triton.cdiv(total, block),)](
        images,
        out,
        mean.float().contiguous(),
        inv_std,
        flip_arg,
        total,
        h,
        w,
        C=c,
        HAS_FLIP=flip is not None,
        BLOCK=block,
    )
    return out
