"""Top-1 / top-5 over every val image exactly once, counted on the device.

Partial batches are padded to the full batch (label -1, not counted) so a compiled eval sees one
static shape. Undecodable val images arrive with label -1 and are left out of the counts too.
The counts cross to the host once, at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class Evaluator:
    def __init__(
        self, model: nn.Module, amp_dtype: torch.dtype | None, compile: bool, batch_size: int
    ):
        self.model = model
        self.amp_dtype = amp_dtype
        self.batch_size = batch_size
        self.device_type = next(model.parameters()).device.type
        # a separate compiled function: eval mode (BN statistics) is another graph, and compiling
        # it apart leaves the training graph untouched
        self.logits = torch.compile(self._logits, dynamic=False) if compile else self._logits

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        with torch.autocast(
            self.device_type,
            dtype=self.amp_dtype or torch.float32,
            enabled=self.amp_dtype is not None,
        ):
            return self.model(images)

    @torch.no_grad()
    def __call__(self, loader: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        counts = None
        try:
            for images, labels in loader:
                n = images.shape[0]
                if n < self.batch_size:  # pad the last batch to the static shape
                    fmt = (
                        torch.channels_last
                        if images.is_contiguous(memory_format=torch.channels_last)
                        else torch.contiguous_format
                    )
                    padded = images.new_zeros((self.batch_size, *images.shape[1:]))
                    images = padded.contiguous(memory_format=fmt).index_copy_(
                        0, torch.arange(n, device=images.device), images
                    )
                    labels = torch.cat([labels, labels.new_full((self.batch_size - n,), -1)])
                logits = self.logits(images)
                k = min(5, logits.shape[1])
                hits = logits.topk(k, dim=1).indices == labels[:, None]
                batch_counts = torch.stack(
                    (hits[:, 0].sum(), hits.any(dim=1).sum(), (labels >= 0).sum())
                )
                counts = batch_counts if counts is None else counts + batch_counts
        finally:
            self.model.train(was_training)
        if counts is None:
            return {"top1": 0.0, "top5": 0.0, "images": 0}
        top1, top5, total = counts.tolist()  # the one host sync of an evaluation
        return {
            "top1": 100.0 * top1 / max(total, 1),
            "top5": 100.0 * top5 / max(total, 1),
            "images": int(total),
        }
