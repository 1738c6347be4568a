"""An exponential moving average of the model's weights (``--model-ema``), updated on the device.

After each update of the model, every parameter of the average moves towards the model's:
``ema += (1 - decay) * (param - ema)``, every ``--model-ema-steps`` optimizer steps, with
timm's warm-up where asked (``decay = min(decay, (1 + n) / (10 + n))`` after ``n`` updates),
so that early weights do not linger. Buffers (BatchNorm's running statistics) are the model's
own, copied at every step, as timm does.

Two forms of one update, held equal by tests: ``update(int)`` for the eager and compiled steps
(the step is a host number there: no device read), and ``update(tensor)`` for the CUDA-graph
step, whose step counter lives on the device; its decay and its every-N choice are then device
arithmetic (``torch.where``, no branch), so the graph captures it and replays it every step.
torch's ``AveragedModel`` reads its update count on the host, which a graph cannot.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class ModelEma:
    """The average of ``model``'s weights: ``module`` is a copy of the model holding it, which
    evaluates and checkpoints like the model (the same state dict keys)."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1, warmup: bool = False):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.every, self.warmup = decay, every, warmup
        self.params = list(self.module.parameters())
        self.source = list(model.parameters())
        self.buffers = list(self.module.buffers())
        self.source_buffers = list(model.buffers())

    def decay_at(self, updates: int) -> float:
        """The decay of update number ``updates`` (1-based)."""
        if self.warmup:
            return min(self.decay, (1 + updates) / (10 + updates))
        return self.decay

    @torch.no_grad()
    def update(self, step: int | Tensor) -> None:
        """Follow the model after optimizer step ``step`` (0-based): a host int, or the CUDA-graph
        step's 0-d device counter."""
        if isinstance(step, Tensor):
            self._update_on_device(step)
        elif (step + 1) % self.every == 0:
            weight = 1 - self.decay_at((step + 1) // self.every)
            torch._foreach_lerp_(self.params, self.source, weight)
        if self.buffers:  # one grouped launch, not one copy per buffer (159 for ResNet-50)
            torch._foreach_copy_(self.buffers, self.source_buffers)

    def _update_on_device(self, step: Tensor) -> None:
        done = step + 1
        updates = torch.div(done, self.every, rounding_mode="floor").to(torch.float32)
        decay = torch.full((), self.decay, dtype=torch.float32, device=step.device)
        if self.warmup:
            decay = torch.minimum(decay, (1 + updates) / (10 + updates))
        weight = torch.where(done % self.every == 0, 1 - decay, torch.zeros_like(decay))
        # ema = ema * (1 - weight) + param * weight: lerp with a device weight
        torch._foreach_mul_(self.params, 1 - weight)
        torch._foreach_add_(self.params, torch._foreach_mul(self.source, weight))

    def state_dict(self) -> dict[str, Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.module.load_state_dict(state)
