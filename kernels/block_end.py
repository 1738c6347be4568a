"""The backward of a residual block's end in the fused ResNet: the gradient masked by the block's
ReLU, written once, and its per-channel sums for the BatchNorm before it, in one pass.

Why: a block's output has two readers in the next block (its first convolution and its identity
path), so its gradient arrives in two parts. In the compiled step inductor adds them and masks
them in one kernel that writes the masked gradient, then reads that gradient back in a second
kernel that sums it per channel for the BN: it does not fuse a pointwise kernel into a reduction
over the outer dimension of a channels_last tensor. Here one kernel reads the two parts, the
block's output and the BN's input, writes the masked gradient and each program's partial sums
(sum of the masked gradient, and of it times the BN's input); torch adds the partials, a few
hundred rows per channel (deterministic: no atomics). One read of a block's output less at
each block end without a downsample but the last: 11 of ResNet-50's 16, about 0.35 of a pass
over every BN output at 224 px.

Registered as the custom op ``fasttrain::masked_sums`` for ``torch.compile``. The reference is
the torch ops ``masked_sums_reference`` runs; the tests hold them together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_C, PROGRAMS = 32, 64, 1024  # rows and channels per tile; programs to aim for


@triton.jit
def _masked_sums(
    g1_ptr, g2_ptr, out_ptr, y_ptr, masked_ptr, psum_ptr, pdot_ptr,
    R, C, ROWS,
    HAS_G2: tl.constexpr, FP64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Rows [pid0 * ROWS, +ROWS) by channels [pid1 * BLOCK_C, +BLOCK_C) of [R, C] tensors (a
    channels_last N x C x H x W seen as N*H*W rows of C): masked = where(out > 0, g1 + g2, 0),
    the sum rounded to the gradient's dtype as torch's add would; partial sums in fp32 (fp64 for
    fp64 tensors) of the stored masked values and of masked * y, one row per program."""
    acc = tl.float64 if FP64 else tl.float32
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    total = tl.zeros((BLOCK_C,), acc)
    dot = tl.zeros((BLOCK_C,), acc)
    first = tl.program_id(0) * ROWS
    for start in range(first, first + ROWS, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        ok = (r < R)[:, None] & c_ok[None, :]
        at = r.to(tl.int64)[:, None] * C + c[None, :]
        g = tl.load(g1_ptr + at, mask=ok, other=0.0)
        if HAS_G2:
            g = (g.to(acc) + tl.load(g2_ptr + at, mask=ok, other=0.0).to(acc)).to(g.dtype)
        out = tl.load(out_ptr + at, mask=ok, other=0.0)
        masked = tl.where(out > 0, g, 0.0).to(g.dtype)
        tl.store(masked_ptr + at, masked, mask=ok)
        wide = masked.to(acc)
        total += tl.sum(wide, axis=0)
        dot += tl.sum(wide * tl.load(y_ptr + at, mask=ok, other=0.0).to(acc), axis=0)
    tl.store(psum_ptr + tl.program_id(0) * C + c, total, mask=c_ok)
    tl.store(pdot_ptr + tl.program_id(0) * C + c, dot, mask=c_ok)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The sums' dtype: fp32, or fp64 for fp64 tensors."""
    return torch.promote_types(dtype, torch.float32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (N x C x H x W) as the [N*H*W, C] rows of its channels_last layout."""
    t = t.contiguous(memory_format=torch.channels_last)
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


@torch.library.custom_op("fasttrain::masked_sums", mutates_args=())
def masked_sums(
    g1: torch.Tensor, g2: torch.Tensor | None, out: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``masked = where(out > 0, g1 + g2, 0)`` (``g2`` may be absent) in ``g1``'s dtype and
    channels_last, with its per-channel sum and the per-channel sum of ``masked * y``, both fp32
    (fp64 for fp64): the gradient a block's end passes back, and the sums its BN's backward
    needs, in one pass."""
    n, c, h, w = out.shape
    masked = torch.empty_like(g1, memory_format=torch.channels_last)
    rows = n * h * w
    blocks_c = triton.cdiv(c, BLOCK_C)
    chunks = max(1, min(triton.cdiv(rows, BLOCK_R), PROGRAMS // blocks_c))
    per = triton.cdiv(triton.cdiv(rows, chunks), BLOCK_R) * BLOCK_R  # rows per program
    grid = (triton.cdiv(rows, per), blocks_c)
    psum = torch.empty(grid[0], c, dtype=_acc(g1.dtype), device=out.device)
    pdot = torch.empty_like(psum)
    m = _rows(masked)
    g1r = _rows(g1)
    _masked_sums[grid](
        g1r, _rows(g2) if g2 is not None else g1r, _rows(out), _rows(y), m, psum, pdot,
        rows, c, per, HAS_G2=g2 is not None, FP64=g1.dtype == torch.float64,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return masked, psum.sum(0), pdot.sum(0)


@masked_sums.register_fake
def _(g1, g2, out, y):
    c = out.shape[1]
    sums = out.new_empty(c, dtype=_acc(g1.dtype))
    return torch.empty_like(g1, memory_format=torch.channels_last), sums, sums.clone()


def masked_sums_reference(
    g1: torch.Tensor, g2: torch.Tensor | None, out: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``masked_sums`` in torch ops: what autograd computes for ``relu(...)``'s input."""
    grad = g1 if g2 is None else g1 + g2
    masked = torch.where(out > 0, grad, 0).contiguous(memory_format=torch.channels_last)
    wide = masked.to(_acc(masked.dtype))
    return masked, wide.sum((0, 2, 3)), (wide * y.to(wide.dtype)).sum((0, 2, 3))
