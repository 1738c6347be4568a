"""A ReLU's mask as one bit per element: the fused model's block ends keep it for the backward
(``conv_bn.residual_relu``) instead of the block's whole output, a sixteenth of the bytes in
fp16. The bits of a pixel's channels ``8j..8j+7`` lie in its byte ``j``, which channels_last
keeps next to each other, so inductor writes them in the kernel that writes the output."""

from __future__ import annotations

import torch
from torch import Tensor

PACK = 8  # channels per byte of a packed sign mask


def pack_signs(t: Tensor) -> Tensor:
    """Whether each element of ``t`` (N, C, H, W; C a multiple of ``PACK``) is above zero, one
    bit each: byte ``j`` of pixel ``(n, h, w)`` (a uint8 tensor (N, H, W, C / 8)) holds channels
    ``8j`` to ``8j + 7``, channel ``8j + i`` in bit ``i``. Written as a sum of 8 shifted bits
    over the channels, which lie next to each other in channels_last, so that inductor computes
    it in the kernel that writes ``t``, not in a pass of its own that reads ``t`` again."""
    n, c, h, w = t.shape
    groups = t.permute(0, 2, 3, 1).reshape(n, h, w, c // PACK, PACK)
    shifts = torch.arange(PACK, device=t.device, dtype=torch.uint8)
    # summed as uint8 (the bits are distinct: no carry), so that the reduction's own output is
    # the byte kept for the backward, not a wider sum that the partitioner might keep instead
    return ((groups > 0).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)


def relu_and_signs(z: Tensor) -> tuple[Tensor, Tensor]:
    """``relu(z)`` (N, C, H, W, channels_last; C a multiple of ``PACK``) and ``pack_signs(z)``,
    written so that inductor makes them one kernel and AOTAutograd's partitioner keeps the
    bits for the backward. The ReLU is read from the bits where they are set (so the forward
    needs them: a node only the backward needs may be recomputed there, from the block's
    output, which is kept anyway), in the bits' own grouping of 8 channels (so the kernel that
    sums them can write the output in the same loop). NaNs pass, as through torch.relu."""
    n, c, h, w = z.shape
    groups = z.permute(0, 2, 3, 1).reshape(n, h, w, c // PACK, PACK)
    shifts = torch.arange(PACK, device=z.device, dtype=torch.uint8)
    signs = ((groups > 0).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)
    positive = ((signs.unsqueeze(-1) >> shifts) & 1) != 0
    out = torch.where(positive, groups, torch.relu(groups))
    return out.reshape(n, h, w, c).permute(0, 3, 1, 2), signs


def unpack_signs(signs: Tensor, shape: torch.Size) -> Tensor:
    """``pack_signs``'s bits as a bool tensor of ``shape`` (N, C, H, W), channels_last."""
    n, c, h, w = shape
    shifts = torch.arange(PACK, device=signs.device, dtype=torch.int32)
    bits = (signs.unsqueeze(-1).to(torch.int32) >> shifts) & 1
    return bits.reshape(n, h, w, c).permute(0, 3, 1, 2) != 0
