"""LARS in torch's foreach ops: the CPU's and DDP's ``--opt lars``, and the plain form of the
Triton kernel's rule (``kernels/sgd.py``), which the tests hold the kernel to.

Per tensor, with its group's weight decay ``wd`` and the trust ratio ``r`` (You et al. 2017;
MLPerf's ResNet-50 recipe), for the groups that decay (BatchNorm and biases keep ``r = 1``):

    d = grad + wd * p;  r = eta * |p| / (|grad| + wd * |p|)  (1 where a norm is 0)
    buf = momentum * buf + r * d;  p -= lr * buf

Every quantity stays on the device: the norms (``torch._foreach_norm``), the ratios
(``torch.where``, no branch on a value) and the LR, which may be a 0-d device tensor, so the
update fits in a CUDA graph. Under fp16, GradScaler hands over its scale and inf check as
tensors (``_step_supports_amp_scaling``): the gradients are unscaled as they are read, and a
step with an inf leaves the weights and the momentum as they were, with no host read. The
gradients are ordinary ``.grad`` tensors, so DDP's buckets work as with any optimizer.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Lars(torch.optim.Optimizer):
    """SGD with momentum and LARS trust ratios, in foreach ops (module notes). ``lr`` may be
    a float or a 0-d device tensor; groups may set ``weight_decay``."""

    # GradScaler (fp16) sets ``grad_scale`` and ``found_inf`` (tensors) on the optimizer before
    # step() and deletes them after: torch's protocol, which multiplies into an existing
    # ``grad_scale``, so the attributes must be absent, not None, between steps
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float | Tensor,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
    ):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.eta = eta

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Lars: no closures")
        scale, inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        inv_scale = None if scale is None else scale.reshape(()).float().reciprocal()
        ok = None if inf is None else inf.reshape(()) == 0  # False after an inf: no change
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if inv_scale is not None:
                grads = torch._foreach_mul(grads, inv_scale)
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)  # p's layout (channels_last)
                bufs.append(state["momentum_buffer"])
            wd, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
            d = torch._foreach_add(grads, params, alpha=wd) if wd else list(grads)
            if wd:
                p_norms = torch._foreach_norm(params)
                g_norms = torch._foreach_norm(grads)
                ratios = [
                    torch.where(
                        (pn > 0) & (gn > 0), self.eta * pn / (gn + wd * pn), torch.ones_like(pn)
                    )
                    for pn, gn in zip(p_norms, g_norms, strict=True)
                ]
                torch._foreach_mul_(d, ratios)
            new_bufs = torch._foreach_mul(bufs, momentum)
            torch._foreach_add_(new_bufs, d)
            if ok is None:
                torch._foreach_copy_(bufs, new_bufs)
                step = bufs
            else:  # a step with an inf (its gradients may be NaN) changes nothing
                step = []
                for buf, new in zip(bufs, new_bufs, strict=True):
                    buf.copy_(torch.where(ok, new, buf))
                    step.append(torch.where(ok, buf, torch.zeros_like(buf)))
            if isinstance(lr, Tensor):
                torch._foreach_add_(params, torch._foreach_mul(step, -lr))
            else:
                torch._foreach_add_(params, step, alpha=-lr)
