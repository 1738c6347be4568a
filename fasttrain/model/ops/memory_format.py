"""Which memory format a tensor is in, for ops that must hand back what they were given."""

from __future__ import annotations

import torch
from torch import Tensor


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last where ``x`` is (and not also plainly contiguous, as a tensor with one
    channel or one pixel is both), else contiguous: what an op's output keeps of its input."""
    if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format
