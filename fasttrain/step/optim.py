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
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from fasttrain.config import OptimConfig
from fasttrain.model.build import param_groups
from fasttrain.step.plan import Plan


@dataclass(frozen=True)
class Schedule:
    peak_lr: float  # base LR scaled to the global batch (the first epoch's, see peak_changes)
    steps_per_epoch: int
    total_steps: int  # over all --epochs, whatever --max-steps says
    warmup_steps: int
    kind: str  # "step" | "cosine" | "poly"
    step_epochs: int
    gamma: float
    power: float = 2.0  # "poly": the decay's power
    # where epochs differ in steps and global batch (``plan.Plan``): from each (step, peak) on,
    # the peak LR is that one; and for "step", the steps where a decay begins (None: every
    # ``step_epochs`` x ``steps_per_epoch`` steps)
    peak_changes: tuple[tuple[int, float], ...] = ()
    decay_starts: tuple[int, ...] | None = None

    def peak_at(self, step: int) -> float:
        peak = self.peak_lr
        for first, value in self.peak_changes:
            if step >= first:
                peak = value
        return peak

    def lr_at(self, step: int) -> float:
        """The LR of optimizer step ``step`` (0-based): linear warmup, then step, cosine or
        polynomial decay (to zero at the last step of --epochs)."""
        peak = self.peak_at(step)
        if step < self.warmup_steps:
            return peak * (step + 1) / self.warmup_steps
        if self.kind == "step":
            if self.decay_starts is None:
                decays = (step // self.steps_per_epoch) // self.step_epochs
            else:
                decays = sum(step >= first for first in self.decay_starts)
            return peak * self.gamma**decays
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "poly":
            return peak * (1 - progress) ** self.power
        return 0.5 * peak * (1 + math.cos(math.pi * progress))

    def lr_tensor(self, step: torch.Tensor) -> torch.Tensor:
        """``lr_at`` as device ops on a 0-d int64 step tensor: capturable, no host reads."""
        s = step.to(torch.float64)
        peak = torch.full_like(s, self.peak_lr)
        before = self.peak_lr
        for first, value in self.peak_changes:
            peak = peak + (step >= first).to(s.dtype) * (value - before)
            before = value
        warm = peak * (s + 1) / max(self.warmup_steps, 1)
        if self.kind == "step":
            if self.decay_starts is None:
                decays = torch.div(
                    step, self.steps_per_epoch * self.step_epochs, rounding_mode="floor"
                ).to(s.dtype)
            else:
                decays = torch.zeros_like(s)
                for first in self.decay_starts:
                    decays = decays + (step >= first).to(s.dtype)
            after = peak * torch.pow(torch.full_like(s, self.gamma), decays)
        else:
            span = max(1, self.total_steps - self.warmup_steps)
            progress = ((s - self.warmup_steps) / span).clamp(max=1.0)
            if self.kind == "poly":
                after = peak * (1 - progress).clamp(min=0) ** self.power
            else:
                after = 0.5 * peak * (1 + torch.cos(math.pi * progress))
        return torch.where(step < self.warmup_steps, warm, after).to(torch.float32)


def _peak(cfg: OptimConfig, global_batch: int) -> float:
    return cfg.lr * global_batch / 256 if cfg.lr_scaling == "linear" else cfg.lr


def build_schedule(
    cfg: OptimConfig, global_batch: int, steps_per_epoch: int, epochs: int
) -> Schedule:
    return Schedule(
        peak_lr=_peak(cfg, global_batch),
        steps_per_epoch=steps_per_epoch,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        kind=cfg.lr_schedule,
        step_epochs=cfg.lr_step_epochs,
        gamma=cfg.lr_gamma,
        power=cfg.lr_power,
    )


def plan_schedule(cfg: OptimConfig, plan: Plan) -> Schedule:
    """``build_schedule`` over epochs that differ in steps and global batch: each epoch's peak LR
    scaled to its own global batch (``--lr-scaling linear``), the warm-up over the steps of the
    first ``--warmup-epochs`` epochs, step decays at the first step of every
    ``--lr-step-epochs``-th epoch, cosine / poly over the run's steps. A uniform plan gives
    ``build_schedule``'s."""
    if plan.is_uniform:
        return build_schedule(cfg, plan.global_batches[0], plan.steps[0], plan.epochs)
    peaks = [_peak(cfg, b) for b in plan.global_batches]
    whole, part = int(cfg.warmup_epochs), cfg.warmup_epochs % 1
    warmup = plan.first_step(whole) + (
        round(part * plan.steps[whole]) if whole < plan.epochs else 0
    )
    every = cfg.lr_step_epochs
    return Schedule(
        peak_lr=peaks[0],
        steps_per_epoch=plan.steps[0],
        total_steps=plan.total_steps,
        warmup_steps=warmup,
        kind=cfg.lr_schedule,
        step_epochs=every,
        gamma=cfg.lr_gamma,
        power=cfg.lr_power,
        peak_changes=tuple(
            (plan.starts[e], peaks[e]) for e in range(1, plan.epochs) if peaks[e] != peaks[e - 1]
        ),
        decay_starts=tuple(plan.starts[e] for e in range(every, plan.epochs, every)),
    )


@runtime_checkable
class InPlaceGradients(Protocol):
    """An optimizer that needs its gradients in place: they are views of one buffer it owns
    (``flat_grad``), so they must be zeroed, never set to None (a CUDA-graphed step zeroes them
    inside the graph), and DDP, which owns its own gradient buckets, cannot use it. fasttrain's
    Triton SGD / LARS (``kernels/sgd.py``, which imports nothing of fasttrain) is one."""

    flat_grad: torch.Tensor  # every parameter's gradient is a view of it


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, initial_lr: float, triton: bool = False
) -> torch.optim.Optimizer:
    """``--opt sgd``: torch's fused SGD, or with ``triton`` fasttrain's Triton SGD over flat
    buffers. ``--opt lars``: with ``triton`` the Triton kernel (one GPU process), else the
    foreach form (``lars.Lars``: the CPU, DDP). The pairs hold the same update rule
    (tests/kernels/test_kernels.py)."""
    groups = param_groups(model, cfg.weight_decay, cfg.bn_weight_decay)
    if triton:
        from fasttrain.kernels.sgd import FusedSGD

        return FusedSGD(
            groups, lr=initial_lr, momentum=cfg.momentum, lars=cfg.opt == "lars", eta=cfg.lars_eta
        )
    if cfg.opt == "lars":
        from fasttrain.step.lars import Lars

        return Lars(groups, lr=initial_lr, momentum=cfg.momentum, eta=cfg.lars_eta)
    return torch.optim.SGD(groups, lr=initial_lr, momentum=cfg.momentum, fused=True)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
