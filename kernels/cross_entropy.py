"""Softmax cross-entropy with label smoothing, forward and backward, one row per program.

The forward keeps each row's log-sum-exp; the backward writes ``softmax - target`` scaled by the
incoming gradient, so the logits' gradient is one pass with no (N, C) intermediate kept for
autograd. Registered as the custom op ``fasttrain::cross_entropy_ls`` (``torch.library``), so
``torch.compile`` sees one op it does not trace into. ``cross_entropy_reference`` is torch's own
``F.cross_entropy(..., label_smoothing=)``; the tests hold them together.

Loss per row, with K classes and smoothing e: ``lse - (1 - e) * x[y] - (e / K) * sum(x)``; the
mean over rows whose label is not -1 (ignored, as the evaluator's padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0
) -> torch.Tensor:
    return F.cross_entropy(logits.float(), labels, label_smoothing=smoothing, ignore_index=-1)


@triton.jit
def _xent_fwd(x_ptr, y_ptr, loss_ptr, lse_ptr, stride, K, smoothing, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    base = x_ptr + row.to(tl.int64) * stride
    # pass 1: running max and sum of exp over the row, in blocks
    m = tl.full((), -float("inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    total = tl.full((), 0.0, tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.where(mask, tl.exp(x - new_m), 0.0), axis=0)
        m = new_m
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(s)
    label = tl.load(y_ptr + row)
    valid = label >= 0
    x_label = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    loss = lse - (1.0 - smoothing) * x_label - smoothing / K * total
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _xent_bwd(x_ptr, y_ptr, lse_ptr, scale_ptr, dx_ptr, stride, K, smoothing, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    base = row.to(tl.int64) * stride
    lse = tl.load(lse_ptr + row)
    label = tl.load(y_ptr + row)
    scale = tl.load(scale_ptr)  # d(mean loss)/d(row loss) = grad_out / valid rows
    scale = tl.where(label >= 0, scale, 0.0)
    for start in range(0, K, BLOCK):
        idx = start + cols
        mask = idx < K
        x = tl.load(x_ptr + base + idx, mask=mask, other=0.0).to(tl.float32)
        target = smoothing / K + tl.where(idx == label, 1.0 - smoothing, 0.0)
        g = (tl.exp(x - lse) - target) * scale
        tl.store(dx_ptr + base + idx, g.to(dx_ptr.dtype.element_ty), mask=mask)


def _block(k: int) -> int:
    return min(4096, triton.next_power_of_2(k))


@torch.library.custom_op("fasttrain::cross_entropy_ls", mutates_args=())
def _xent(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = logits.shape
    logits = logits.contiguous()
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    _xent_fwd[(n,)](logits, labels, loss, lse, logits.stride(0), k, smoothing, BLOCK=_block(k))
    valid = (labels >= 0).sum().clamp(min=1)
    return loss.sum() / valid, lse


@_xent.register_fake
def _(logits, labels, smoothing):
    n = logits.shape[0]
    return logits.new_empty((), dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("fasttrain::cross_entropy_ls_backward", mutates_args=())
def _xent_backward(
    grad: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    smoothing: float,
) -> torch.Tensor:
    n, k = logits.shape
    logits = logits.contiguous()
    dx = torch.empty_like(logits)
    scale = (grad.float() / (labels >= 0).sum().clamp(min=1)).reshape(1)
    _xent_bwd[(n,)](logits, labels, lse, scale, dx, logits.stride(0), k, smoothing, BLOCK=_block(k))
    return dx


@_xent_backward.register_fake
def _(grad, logits, labels, lse, smoothing):
    return torch.empty_like(logits)


def _setup(ctx, inputs, output):
    logits, labels, smoothing = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.smoothing = smoothing


def _backward(ctx, grad_loss, grad_lse):
    logits, labels, lse = ctx.saved_tensors
    return _xent_backward(grad_loss, logits, labels, lse, ctx.smoothing), None, None


_xent.register_autograd(_backward, setup_context=_setup)


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy with label smoothing over rows whose label is not -1."""
    return _xent(logits, labels, float(smoothing))[0]


class CrossEntropy(torch.nn.Module):
    """Drop-in for ``nn.CrossEntropyLoss(label_smoothing=)`` running the fused kernel."""

    def __init__(self, label_smoothing: float = 0.0):
        super().__init__()
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, labels, self.label_smoothing)
