"""TrainStep: one optimizer step over ``accum_steps`` micro-batches, with one interface.

- ``EagerStep``: the simple reference.
- ``CompiledStep``: the same step with forward + loss compiled by ``torch.compile`` (the backward is
  compiled through AOTAutograd). Tests hold it to the eager step.
The whole-step CUDA graph comes with ``--cuda-graphs`` (its own issue) and plugs in here.

Nothing here reads a device value on the host: loss and accuracy go into device accumulators
(``metrics.DeviceMeter``) that are read only at log steps. The one exception is fp16's GradScaler,
whose ``step`` checks for inf/NaN on the host every step; bf16 needs no scaler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fasttrain.metrics import DeviceMeter

Batch = tuple[torch.Tensor, torch.Tensor]


class EagerStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module,
        amp_dtype: torch.dtype | None,
        scaler: torch.amp.GradScaler | None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.criterion = criterion
        self.amp_dtype = amp_dtype
        self.scaler = scaler
        self.device_type = next(model.parameters()).device.type
        self.forward = self._forward

    def _forward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(
            self.device_type,
            dtype=self.amp_dtype or torch.float32,
            enabled=self.amp_dtype is not None,
        ):
            logits = self.model(images)
            loss = self.criterion(logits, labels)
        correct = (logits.argmax(dim=1) == labels).sum()
        return loss, correct

    def __call__(self, batches: Sequence[Batch], meter: DeviceMeter) -> None:
        for images, labels in batches:
            loss, correct = self.forward(images, labels)
            scaled = loss / len(batches)
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
            meter.add(loss.detach(), correct, images.shape[0])
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # set to None: backward then hands over fresh gradients instead of adding into zeroed ones,
        # one kernel fewer per parameter (measured +1.6% eager on an H200, bench/eager_overhead.py).
        # The CUDA-graph step will zero in place instead, since it needs fixed gradient addresses.
        self.optimizer.zero_grad(set_to_none=True)


class CompiledStep(EagerStep):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # dynamic=False: the train loader's shapes never change, so never trace a dynamic graph
        self.forward = torch.compile(self._forward, dynamic=False)


def build_step(
    compile: bool,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: nn.Module,
    amp_dtype: torch.dtype | None,
    scaler: torch.amp.GradScaler | None,
) -> EagerStep:
    cls = CompiledStep if compile else EagerStep
    return cls(model, optimizer, criterion, amp_dtype, scaler)
