"""SGD with momentum, and the LR schedule as a pure function of the optimizer step.

The schedule has two forms that tests hold equal: ``lr_at`` on the host (eager and compiled steps
write it into the param groups as a Python float, which never reads the device), and ``lr_tensor``
on the device, which the CUDA-graph step computes inside the graph from a device step counter, so
the LR changes every replay without a recapture or a host write.

The optimizer is torch's fused SGD (one kernel for every parameter of a device and dtype): it
takes the LR as a device tensor, and GradScaler hands it the inf check as a tensor, so both fit in
a CUDA graph with no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fasttrain.config import OptimConfig
from fasttrain.model import param_groups


@dataclass(frozen=True)
class Schedule:
    peak_lr: float  # base LR scaled to the global batch
    steps_per_epoch: int
    total_steps: int  # over all --epochs, whatever --max-steps says
    warmup_steps: int
    kind: str  # "step" | "cosine" | "poly"
    step_epochs: int
    gamma: float
    power: float = 2.0  # "poly": the decay's power

    def lr_at(self, step: int) -> float:
        """The LR of optimizer step ``step`` (0-based): linear warmup, then step, cosine or
        polynomial decay (to zero at the last step of --epochs)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "step":
            return self.peak_lr * self.gamma ** ((step // self.steps_per_epoch) // self.step_epochs)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "poly":
            return self.peak_lr * (1 - progress) ** self.power
        return 0.5 * self.peak_lr * (1 + math.cos(math.pi * progress))

    def lr_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """``lr_at`` as device ops on a 0-d int64 step tensor: capturable, no host reads."""
        s = step.to(torch.float64)
        warm = self.peak_lr * (s + 1) / max(self.warmup_steps, 1)
        if self.kind == "step":
            decays = torch.div(step, self.steps_per_epoch * self.step_epochs, rounding_mode="floor")
            after = self.peak_lr * torch.pow(torch.full_like(s, self.gamma), decays.to(s.dtype))
        else:
            span = max(1, self.total_steps - self.warmup_steps)
            progress = ((s - self.warmup_steps) / span).clamp(max=1.0)
            if self.kind == "poly":
                after = self.peak_lr * (1 - progress).clamp(min=0) ** self.power
            else:
                after = 0.5 * self.peak_lr * (1 + torch.cos(math.pi * progress))
        return torch.where(step < self.warmup_steps, warm, after).to(torch.float32)


def build_schedule(
    cfg: OptimConfig, global_batch: int, steps_per_epoch: int, epochs: int
) -> Schedule:
    return Schedule(
        peak_lr=cfg.lr * global_batch / 256 if cfg.lr_scaling == "linear" else cfg.lr,
        steps_per_epoch=steps_per_epoch,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        kind=cfg.lr_schedule,
        step_epochs=cfg.lr_step_epochs,
        gamma=cfg.lr_gamma,
        power=cfg.lr_power,
    )


class InPlaceGradients(torch.optim.Optimizer):
    """An optimizer that needs its gradients in place: they are views of buffers it owns, so
    they must be zeroed, never set to None (a CUDA-graphed step zeroes them inside the graph),
    and DDP, which owns its own gradient buckets, cannot use it. fasttrain's Triton SGD / LARS
    (``kernels/sgd.py``) is one."""


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, initial_lr: float, triton: bool = False
) -> torch.optim.Optimizer:
    """``--opt sgd``: torch's fused SGD, or with ``triton`` fasttrain's Triton SGD over flat
    buffers. ``--opt lars``: with ``triton`` the Triton kernel (one GPU process), else the
    foreach form (``lars.Lars``: the CPU, DDP). The pairs hold the same update rule
    (tests/test_kernels.py)."""
    groups = param_groups(model, cfg.weight_decay, cfg.bn_weight_decay)
    if triton:
        from fasttrain.kernels.sgd import FusedSGD

        return FusedSGD(
            groups, lr=initial_lr, momentum=cfg.momentum, lars=cfg.opt == "lars", eta=cfg.lars_eta
        )
    if cfg.opt == "lars":
        from fasttrain.lars import Lars

        return Lars(groups, lr=initial_lr, momentum=cfg.momentum, eta=cfg.lars_eta)
    return torch.optim.SGD(groups, lr=initial_lr, momentum=cfg.momentum, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
