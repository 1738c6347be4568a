"""SGD with momentum, and the LR schedule as a pure function of the optimizer step.

The schedule is computed on the host from an integer step counter and written into the param
groups as a Python float, so applying it never reads the device (no host sync). The CUDA-graph step
moves the LR into a device tensor so a change of LR never triggers a recapture.
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
    kind: str  # "step" | "cosine"
    step_epochs: int
    gamma: float

    def lr_at(self, step: int) -> float:
        """The LR of optimizer step ``step`` (0-based): linear warmup, then step or cosine decay."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "step":
            return self.peak_lr * self.gamma ** ((step // self.steps_per_epoch) // self.step_epochs)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * self.peak_lr * (1 + math.cos(math.pi * progress))


def build_schedule(
    cfg: OptimConfig, global_batch: int, steps_per_epoch: int, epochs: int
) -> Schedule:
    return Schedule(
        peak_lr=cfg.lr * global_batch / 256,
        steps_per_epoch=steps_per_epoch,
        total_steps=steps_per_epoch * epochs,
        warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
        kind=cfg.lr_schedule,
        step_epochs=cfg.lr_step_epochs,
        gamma=cfg.lr_gamma,
    )


def build_optimizer(model: nn.Module, cfg: OptimConfig, initial_lr: float) -> torch.optim.SGD:
    groups = param_groups(model, cfg.weight_decay, cfg.bn_weight_decay)
    return torch.optim.SGD(groups, lr=initial_lr, momentum=cfg.momentum)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
