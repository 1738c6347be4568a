"""Everything one optimizer step touches, as one value: what checkpoints save and restore, and
what the loop and the fault handling hand around."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fasttrain.step.ema import ModelEma
from fasttrain.step.erase import Eraser
from fasttrain.step.mix import Mixer
from fasttrain.step.optim import Schedule
from fasttrain.step.step import TrainStep


@dataclass
class Training:
    """Everything one optimizer step touches."""

    model: nn.Module  # the raw module: checkpoints and evaluation use it
    net: nn.Module  # what the step trains: ``model``, or DDP / DataParallel around it
    schedule: Schedule
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    scaler: torch.amp.GradScaler | None
    step: TrainStep
    ema: ModelEma | None = None  # --model-ema: the average of ``model``'s weights
    mixer: Mixer | None = None  # --mixup-alpha / --cutmix-alpha
    eraser: Eraser | None = None  # --random-erase

    def augments(self) -> dict[str, Mixer | Eraser]:
        """The batch augmentations by name: their generators' states go into checkpoints."""
        named = {"mix": self.mixer, "erase": self.eraser}
        return {name: a for name, a in named.items() if a is not None}
