"""ResNet's stem max-pool (3x3, stride 2, padding 1), forward and backward, streamed row by row.

Why: the window-by-window kernels of ``maxpool`` gather each output's nine inputs (and, in the
backward, each input's four windows) from L2 on every visit, so their memory traffic through the
caches is 2-4 times what reaches DRAM, and the fused path's stem recomputes its BN's affine + ReLU
for every visit. At 256 x 64 x 112 x 112 fp16 on an H200 they moved 1.4-1.6 TB/s. Here a program
walks down a strip of output rows, and a window row of input is read once per strip and shared by
the two output rows that hold it:

- forward: each input row's max over its three columns is taken once (the first maximum wins,
  NaN takes over, as in torch), then three of those rows make an output row; the last one is
  carried to the next output row, whose first row it is;
- backward: each output row's gradient is read once and sent to the two input rows it alone
  covers and, carried, to the row it shares with the next output row.

The same values and argmax offsets (int8, ``kh * 3 + kw``, as ``maxpool``'s) as the window
kernels, which stay the reference and run every other pool. The forward can also store the
input each output took (``picked``), and the backward can finish a BN's backward as it writes
(``bn``: the mask, the scale and the statistics' share), for ``fasttrain.bn_pool``. Channels
are the contiguous dimension in channels_last, so each load is a run of whole pixels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# output rows per program, output columns, channels, warps: forward (affine or not) and backward,
# the fastest of bench/test_kernels.py's sweep (fp16, 256 x 64 x 112 x 112, on an H200)
TILE_FWD = (14, 8, 64, 2)
TILE_BWD = (4, 32, 64, 8)
# the backward with the BN folded in (it also reads the BN's input): the fastest of its own sweep
# (bench/test_kernels.py's test_maxpool_bn_backward), 355 us against 422 at TILE_BWD
TILE_BN_BWD = (14, 8, 64, 4)


def applies(kernel: int, stride: int, padding: int) -> bool:
    """Whether these kernels compute this pool: the 3x3/2 pad-1 of ResNet's stem."""
    return (kernel, stride, padding) == (3, 2, 1)


@triton.jit
def _strip(C, OH, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's work: image n (int64, for the batch stride), output rows from oh0, output
    columns ow, channels c and their mask."""
    strips = tl.cdiv(OH, ROWS)
    n = (tl.program_id(0) // strips).to(tl.int64)
    oh0 = (tl.program_id(0) % strips) * ROWS
    ow = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    return n, oh0, ow, c, c < C


@triton.jit
def _row_max(
    x_row, row_ok, c, c_ok, sxc, sxw, ow, OW, W, scale, bias,
    AFFINE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One input row's max over each window's three columns (2ow-1, 2ow, 2ow+1), fp32, the
    column (kw) of its first maximum and the input there (before the affine + ReLU); -inf where
    the row or column is padding."""
    best = tl.full((BLOCK_W, BLOCK_C), -float("inf"), tl.float32)
    raw = tl.full((BLOCK_W, BLOCK_C), -float("inf"), tl.float32)
    # torch starts from the window's first in-bounds column: 2ow - 1 is padding for ow == 0
    arg = tl.zeros((BLOCK_W, BLOCK_C), tl.int32) + tl.where(ow == 0, 1, 0)[:, None]
    for kw in tl.static_range(3):
        col = 2 * ow - 1 + kw
        ok = (ow < OW) & (col >= 0) & (col < W) & row_ok
        m = ok[:, None] & c_ok[None, :]
        v = tl.load(x_row + col[:, None] * sxw + c[None, :] * sxc, mask=m, other=-float("inf"))
        v = v.to(tl.float32)
        x = v
        if AFFINE:  # relu(x * scale + bias) rounded to x's dtype as torch stores it; padding -inf
            z = tl.where(m, v, 0.0) * scale + bias
            z = tl.where(z < 0.0, 0.0, z).to(x_row.dtype.element_ty).to(tl.float32)
            v = tl.where(m, z, -float("inf"))
        take = (v > best) | (v != v)  # as torch: a greater value, or NaN, takes over
        best = tl.where(take, v, best)
        arg = tl.where(take, kw, arg)
        raw = tl.where(take, x, raw)
    return best, arg, raw


@triton.jit
def _fwd(
    x_ptr, out_ptr, off_ptr, picked_ptr, scale_ptr, bias_ptr,
    C, H, W, OH, OW,
    sxn, sxc, sxh, sxw, son, soc, soh, sow,
    AFFINE: tl.constexpr, PICKED: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    n, oh0, ow, c, c_ok = _strip(C, OH, ROWS, BLOCK_W, BLOCK_C)
    scale = 0.0
    bias = 0.0
    if AFFINE:
        scale = tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    x_n = x_ptr + n * sxn
    mask = (ow < OW)[:, None] & c_ok[None, :]
    # the strip's first window row, 2 * oh0 - 1 (padding above output row 0)
    ih = 2 * oh0 - 1
    carry, carry_kw, carry_x = _row_max(
        x_n + tl.cast(ih, tl.int64) * sxh, ih >= 0, c, c_ok, sxc, sxw, ow, OW, W, scale, bias,
        AFFINE, BLOCK_W, BLOCK_C,
    )  # fmt: skip
    for oh in range(oh0, tl.minimum(oh0 + ROWS, OH)):
        # torch starts from the window's first in-bounds element: row 2oh - 1 is padding at oh 0
        best = tl.full((BLOCK_W, BLOCK_C), -float("inf"), tl.float32)
        picked = tl.full((BLOCK_W, BLOCK_C), -float("inf"), tl.float32)
        arg = tl.zeros((BLOCK_W, BLOCK_C), tl.int32) + tl.where(oh == 0, 3, 0)
        arg += tl.where(ow == 0, 1, 0)[:, None]
        take = (carry > best) | (carry != carry)  # window row 0: the carried input row
        best = tl.where(take, carry, best)
        arg = tl.where(take, carry_kw, arg)
        picked = tl.where(take, carry_x, picked)
        for kh in tl.static_range(1, 3):
            ih = 2 * oh - 1 + kh
            x_row = x_n + tl.cast(ih, tl.int64) * sxh
            v, v_kw, v_x = _row_max(
                x_row, ih < H, c, c_ok, sxc, sxw, ow, OW, W, scale, bias, AFFINE, BLOCK_W, BLOCK_C
            )
            take = (v > best) | (v != v)
            best = tl.where(take, v, best)
            arg = tl.where(take, kh * 3 + v_kw, arg)
            picked = tl.where(take, v_x, picked)
            carry, carry_kw, carry_x = v, v_kw, v_x  # after kh 2: the next output row's row 0
        at = n * son + tl.cast(oh, tl.int64) * soh + ow[:, None] * sow + c[None, :] * soc
        tl.store(out_ptr + at, best.to(out_ptr.dtype.element_ty), mask=mask)
        if PICKED:  # the input each output took, in the output's layout
            tl.store(picked_ptr + at, picked.to(picked_ptr.dtype.element_ty), mask=mask)
        off = off_ptr + ((n * OH + oh) * OW + ow)[:, None] * C + c[None, :]
        tl.store(off, arg.to(tl.int8), mask=mask)


@triton.jit
def _picked(g_row, o_row, c, c_ok, sgc, sgw, ow, OW, C):
    """One output row's gradient at columns ``ow`` (fp32, 0 past the edge) and its argmax
    offsets (-1 past the edge)."""
    m = (ow < OW)[:, None] & c_ok[None, :]
    g = tl.load(g_row + ow[:, None] * sgw + c[None, :] * sgc, mask=m, other=0.0).to(tl.float32)
    o = tl.load(o_row + ow[:, None] * C + c[None, :], mask=m, other=-1).to(tl.int32)
    return g, o


@triton.jit
def _carried(g, o, g1, o1):
    """What an output row sends the input row below it (its window row kh 2), which the next
    output row's kh 0 completes: at even columns from window ow (kw 1), at odd columns from
    windows ow (kw 2) and ow + 1 (kw 0); ``g1``, ``o1`` are the row at ow + 1."""
    return tl.where(o == 7, g, 0.0), tl.where(o == 8, g, 0.0) + tl.where(o1 == 6, g1, 0.0)


@triton.jit
def _put(dx_ptr, y_ptr, row, cols, ga, m, scale, bias, c0, c1, BN: tl.constexpr):
    """Store an input row's gradient ``ga`` at ``cols`` (offsets from the row, which ``y``
    shares with ``dx``). With ``BN``, the gradient of the BN + ReLU before the pool instead:
    ``ga`` rounded as the pool's gradient is stored, masked by the pre-activation recomputed
    from ``y``, times the scale, plus the statistics' gradient ``c0 + c1 * y`` per channel."""
    if BN:
        ga = ga.to(dx_ptr.dtype.element_ty).to(tl.float32)
        y = tl.load(y_ptr + row + cols, mask=m, other=0.0).to(tl.float32)
        live = tl.where(y * scale + bias > 0.0, 1.0, 0.0)  # a product, as torch's: NaN stays
        ga = ga * live * scale + c0 + c1 * y
    tl.store(dx_ptr + row + cols, ga.to(dx_ptr.dtype.element_ty), mask=m)


@triton.jit
def _bwd(
    g_ptr, off_ptr, dx_ptr, y_ptr, scale_ptr, bias_ptr, c0_ptr, c1_ptr,
    C, H, W, OH, OW,
    sgn, sgc, sgh, sgw, sdn, sdc, sdh, sdw,
    BN: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    n, oh0, ow, c, c_ok = _strip(C, OH, ROWS, BLOCK_W, BLOCK_C)
    scale = 0.0
    bias = 0.0
    c0 = 0.0
    c1 = 0.0
    if BN:
        scale = tl.load(scale_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        bias = tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        c0 = tl.load(c0_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        c1 = tl.load(c1_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ok = (ow < OW)[:, None] & c_ok[None, :]
    # input column 2ow is in window ow only (kw 1); 2ow + 1 in windows ow (kw 2) and ow + 1 (kw 0)
    even_cols = (2 * ow)[:, None] * sdw + c[None, :] * sdc
    odd_cols = (2 * ow + 1)[:, None] * sdw + c[None, :] * sdc
    odd_ok = ok & (2 * ow + 1 < W)[:, None]
    g_n, o_n = g_ptr + n * sgn, off_ptr + n * OH * OW * C
    dx_n, y_n = dx_ptr + n * sdn, y_ptr + n * sdn
    # input row 2oh + 1 is in output rows oh (kh 2) and oh + 1 (kh 0): what row oh sends it is
    # carried to the next row; a strip starts from the row above it (none above row 0)
    prev = tl.maximum(oh0 - 1, 0)
    g_row, o_row = g_n + tl.cast(prev, tl.int64) * sgh, o_n + prev * OW * C
    g, o = _picked(g_row, o_row, c, c_ok, sgc, sgw, ow, OW, C)
    g1, o1 = _picked(g_row, o_row, c, c_ok, sgc, sgw, ow + 1, OW, C)
    carry_even, carry_odd = _carried(g, o, g1, o1)
    oh_end = tl.minimum(oh0 + ROWS, OH)
    for oh in range(oh0, oh_end):
        g_row, o_row = g_n + tl.cast(oh, tl.int64) * sgh, o_n + oh * OW * C
        g, o = _picked(g_row, o_row, c, c_ok, sgc, sgw, ow, OW, C)
        g1, o1 = _picked(g_row, o_row, c, c_ok, sgc, sgw, ow + 1, OW, C)
        # input row 2oh - 1: the carry plus this row's kh 0 (none above output row 0)
        above = tl.cast(2 * oh - 1, tl.int64) * sdh
        even = carry_even + tl.where(o == 1, g, 0.0)
        odd = carry_odd + tl.where(o == 2, g, 0.0) + tl.where(o1 == 0, g1, 0.0)
        _put(dx_n, y_n, above, even_cols, even, ok & (oh > 0), scale, bias, c0, c1, BN)
        _put(dx_n, y_n, above, odd_cols, odd, odd_ok & (oh > 0), scale, bias, c0, c1, BN)
        # input row 2oh: this row's kh 1 alone
        mid = tl.cast(2 * oh, tl.int64) * sdh
        even = tl.where(o == 4, g, 0.0)
        odd = tl.where(o == 5, g, 0.0) + tl.where(o1 == 3, g1, 0.0)
        _put(dx_n, y_n, mid, even_cols, even, ok, scale, bias, c0, c1, BN)
        _put(dx_n, y_n, mid, odd_cols, odd, odd_ok, scale, bias, c0, c1, BN)
        carry_even, carry_odd = _carried(g, o, g1, o1)
    # the last output row's strip also writes the input's last row, 2 OH - 1, where it exists
    last = (oh_end == OH) & (2 * OH - 1 < H)
    below = tl.cast(2 * OH - 1, tl.int64) * sdh
    _put(dx_n, y_n, below, even_cols, carry_even, ok & last, scale, bias, c0, c1, BN)
    _put(dx_n, y_n, below, odd_cols, carry_odd, odd_ok & last, scale, bias, c0, c1, BN)


def forward(
    x: torch.Tensor,
    out: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    picked: torch.Tensor | None = None,
) -> None:
    """Pool ``x`` (N, C, H, W), or ``relu(x * scale + bias)`` per channel, into ``out`` and its
    int8 argmax ``offsets`` (N, OH, OW, C); with ``picked`` (``out``'s shape and strides), also
    the input value each output took."""
    n, c, h, w = x.shape
    oh, ow = out.shape[2:]
    rows, bw, bc, warps = TILE_FWD
    affine = scale is not None
    if picked is not None and picked.stride() != out.stride():
        raise ValueError("maxpool_rows.forward: picked must have the output's strides")
    grid = (n * triton.cdiv(oh, rows), triton.cdiv(ow, bw), triton.cdiv(c, bc))
    _fwd[grid](
        x, out, offsets, x if picked is None else picked,
        scale if affine else x, bias if affine else x,
        c, h, w, oh, ow, *x.stride(), *out.stride(),
        AFFINE=affine, PICKED=picked is not None,
        ROWS=rows, BLOCK_W=bw, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip


def backward(
    grad: torch.Tensor,
    offsets: torch.Tensor,
    dx: torch.Tensor,
    bn: tuple[torch.Tensor, ...] | None = None,
) -> None:
    """The input's gradient into ``dx`` (every element written) from the output's ``grad`` and
    the forward's ``offsets``. With ``bn`` = (y, scale, bias, c0, c1), ``dx`` is instead the
    gradient of ``y`` through ``relu(y * scale + bias)`` before the pool, plus ``c0 + c1 * y``
    per channel (the gradient a BN's statistics pass back); ``y`` has ``dx``'s strides."""
    n, c, oh, ow = grad.shape
    h, w = dx.shape[2:]
    rows, bw, bc, warps = TILE_BWD if bn is None else TILE_BN_BWD
    if bn is not None and bn[0].stride() != dx.stride():
        raise ValueError("maxpool_rows.backward: y must have dx's strides")
    y, scale, bias, c0, c1 = (dx,) * 5 if bn is None else bn
    grid = (n * triton.cdiv(oh, rows), triton.cdiv(ow, bw), triton.cdiv(c, bc))
    _bwd[grid](
        grad, offsets, dx, y, scale, bias, c0, c1, c, h, w, oh, ow, *grad.stride(), *dx.stride(),
        BN=bn is not None, ROWS=rows, BLOCK_W=bw, BLOCK_C=bc, num_warps=warps,
    )  # fmt: skip
