"""SGD with momentum and weight decay, and LARS, over flat buffers: one update launch for every
parameter (plus one norm launch for LARS), with the LR read from a device tensor, so the update
fits in a CUDA graph.

At construction the parameters, their gradients and the momentum move into three flat fp32
buffers; each ``p``, ``p.grad`` and momentum buffer becomes a view into them (each tensor padded to
a whole block, so a block belongs to one tensor). Gradients therefore stay in place:
``zero_grad`` zeroes the flat buffer in one launch instead of dropping the tensors.

Update, per tensor with weight decay ``wd`` (its group's) and trust ratio ``r`` (1 for SGD):

    g = grad + wd * p;  buf = momentum * buf + r * g;  p -= lr * buf

LARS (You et al. 2017; MLPerf's ResNet-50 recipe) sets ``r = eta * |p| / (|grad| + wd * |p|)``
per tensor when both norms are non-zero, for the groups that decay (BatchNorm and biases, in the
no-decay group, keep r = 1). ``lars_reference`` is the same rule in plain torch; with
``lars=False`` the update is torch's own SGD (dampening 0, not Nesterov): the tests hold both.

Under fp16, GradScaler gives the optimizer its scale and inf check as device tensors
(``_step_supports_amp_scaling``): the update unscales the gradients as it reads them and writes
nothing when an inf was found, with no host read, so the fp16 step can be captured too.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _sq_norms(p_ptr, g_ptr, offsets_ptr, sizes_ptr, out_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    start = tl.load(offsets_ptr + t)
    size = tl.load(sizes_ptr + t)
    cols = tl.arange(0, BLOCK)
    acc_p = tl.full((BLOCK,), 0.0, tl.float32)
    acc_g = tl.full((BLOCK,), 0.0, tl.float32)
    for i in range(0, size, BLOCK):
        p = tl.load(p_ptr + start + i + cols)  # padded to whole blocks: no mask needed
        g = tl.load(g_ptr + start + i + cols)
        acc_p += p * p
        acc_g += g * g
    tl.store(out_ptr + 2 * t, tl.sum(acc_p, axis=0))
    tl.store(out_ptr + 2 * t + 1, tl.sum(acc_g, axis=0))


@triton.jit
def _update(
    p_ptr,
    g_ptr,
    buf_ptr,
    block_tensor_ptr,
    wd_ptr,
    lars_ptr,
    norms_ptr,
    lr_ptr,
    grad_scale_ptr,
    found_inf_ptr,
    momentum,
    eta,
    HAS_LARS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(block_tensor_ptr + b)
    wd = tl.load(wd_ptr + t)
    lr = tl.load(lr_ptr)
    p = tl.load(p_ptr + offs)
    g = tl.load(g_ptr + offs)
    inv_scale = 1.0
    if HAS_SCALE:  # GradScaler's scale, still in the gradients: unscale on the fly
        inv_scale = 1.0 / tl.load(grad_scale_ptr)
        g = g * inv_scale
    g = g + wd * p
    ratio = 1.0
    if HAS_LARS:
        use = tl.load(lars_ptr + t)
        p_norm = tl.sqrt(tl.load(norms_ptr + 2 * t))
        g_norm = tl.sqrt(tl.load(norms_ptr + 2 * t + 1)) * inv_scale  # norms of scaled grads
        trust = eta * p_norm / (g_norm + wd * p_norm)
        ok = (use != 0) & (p_norm > 0) & (g_norm > 0)
        ratio = tl.where(ok, trust, 1.0)
    buf = momentum * tl.load(buf_ptr + offs) + ratio * g
    if HAS_INF:  # GradScaler found inf/NaN in the gradients: then this step changes nothing
        keep = tl.load(found_inf_ptr + tl.zeros((BLOCK,), tl.int32)) == 0
        tl.store(buf_ptr + offs, buf, mask=keep)
        tl.store(p_ptr + offs, p - lr * buf, mask=keep)
    else:
        tl.store(buf_ptr + offs, buf)
        tl.store(p_ptr + offs, p - lr * buf)


class FusedSGD(torch.optim.Optimizer):
    """SGD (or LARS) over flat buffers. Groups may set ``weight_decay``; LARS applies to the
    groups whose weight decay is non-zero. ``lr`` may be a float or a 0-d device tensor. Every
    gradient is a view of ``flat_grad``: fasttrain's ``InPlaceGradients``."""

    # GradScaler (fp16) then sets ``grad_scale`` and ``found_inf`` (device tensors) before step()
    # instead of unscaling with a host read of the inf check: the kernel unscales and skips on
    # the device, so the fp16 step fits in a CUDA graph (as torch's fused SGD does)
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        lr: float | torch.Tensor,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        lars: bool = False,
        eta: float = 0.001,
    ):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)
        if len({g["momentum"] for g in self.param_groups}) != 1:
            raise ValueError("FusedSGD: one momentum for every group")
        self.lars, self.eta = lars, eta
        self.momentum = self.param_groups[0]["momentum"]
        tensors = [(p, g) for g in self.param_groups for p in g["params"]]
        device = tensors[0][0].device
        sizes = [math.ceil(p.numel() / BLOCK) * BLOCK for p, _ in tensors]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        self.flat_param = torch.zeros(total, dtype=torch.float32, device=device)
        self.flat_grad = torch.zeros_like(self.flat_param)
        self.flat_buf = torch.zeros_like(self.flat_param)
        for (p, _), off in zip(tensors, offsets, strict=True):
            if p.dtype != torch.float32:
                raise ValueError("FusedSGD: fp32 parameters only (AMP keeps them fp32)")
            n = p.numel()
            # keep each parameter's memory layout (channels_last convolutions stay so)
            strides = p.stride() if _dense(p) else torch.empty(p.shape).stride()
            view = self.flat_param[off : off + n].as_strided(p.shape, strides)
            view.copy_(p.detach())
            p.data = view
            p.grad = self.flat_grad[off : off + n].as_strided(p.shape, strides)
            self.state[p]["momentum_buffer"] = self.flat_buf[off : off + n].as_strided(
                p.shape, strides
            )
        blocks = [i for i, s in enumerate(sizes) for _ in range(s // BLOCK)]
        self.block_tensor = torch.tensor(blocks, dtype=torch.int32, device=device)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self.wd = torch.tensor([g["weight_decay"] for _, g in tensors], device=device)
        self.use_lars = torch.tensor(
            [int(lars and g["weight_decay"] != 0) for _, g in tensors],
            dtype=torch.uint8,
            device=device,
        )
        self.norms = torch.zeros(2 * len(tensors), dtype=torch.float32, device=device)
        self.lr_buffer = torch.zeros((), dtype=torch.float32, device=device)

    def _lr(self) -> torch.Tensor:
        lr = self.param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):  # set on every group by set_lr (the graphed step)
            return lr
        if any(g["lr"] != lr for g in self.param_groups):
            raise ValueError("FusedSGD: one LR for every group")
        self.lr_buffer.fill_(lr)  # a host float: one fill launch, no sync
        return self.lr_buffer

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FusedSGD: no closures")
        lr = self._lr()
        if self.lars:
            _sq_norms[(len(self.sizes),)](
                self.flat_param, self.flat_grad, self.offsets, self.sizes, self.norms, BLOCK=BLOCK
            )
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step, else absent
        found_inf = getattr(self, "found_inf", None)
        _update[(len(self.block_tensor),)](
            self.flat_param,
            self.flat_grad,
            self.flat_buf,
            self.block_tensor,
            self.wd,
            self.use_lars,
            self.norms,
            lr,
            grad_scale.float() if grad_scale is not None else lr,  # lr: unused placeholder
            found_inf.float() if found_inf is not None else lr,
            self.momentum,
            self.eta,
            HAS_LARS=self.lars,
            HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None,
            BLOCK=BLOCK,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer in place (the gradients are views into it)."""
        self.flat_grad.zero_()

    def load_state_dict(self, state_dict) -> None:
        """Copy saved momentum into the flat buffer's views (a plain load would replace them)."""
        views = {
            id(p): self.state[p]["momentum_buffer"] for g in self.param_groups for p in g["params"]
        }
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for p in g["params"]:
                loaded = self.state[p].get("momentum_buffer")
                view = views[id(p)]
                if loaded is not None and loaded is not view:
                    view.copy_(loaded)
                self.state[p]["momentum_buffer"] = view


def _dense(p: torch.Tensor) -> bool:
    """A parameter whose strides are a permutation of a dense layout (channels_last convs)."""
    return p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last)


@torch.no_grad()
def lars_reference(
    params, grads, bufs, lr: float, momentum: float, wd: float, eta: float, lars: bool
) -> None:
    """The rule ``_update`` implements, tensor by tensor in plain torch."""
    for p, g, buf in zip(params, grads, bufs, strict=True):
        d = g + wd * p
        ratio = 1.0
        if lars and wd != 0:
            pn, gn = p.norm(), g.norm()
            if pn > 0 and gn > 0:
                ratio = float(eta * pn / (gn + wd * pn))
        buf.mul_(momentum).add_(d, alpha=ratio)
        p.sub_(lr * buf)
