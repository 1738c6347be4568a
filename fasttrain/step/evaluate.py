"""Top-1 / top-5 over every val image exactly once, counted on the device.

Partial batches are padded to the full batch (label -1, not counted) so a compiled eval sees one
static shape. Undecodable val images arrive with label -1 and are left out of the counts too.
The counts cross to the host once, at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fasttrain.dist.state import DistState
from fasttrain.step.graphs import blame, capture, on_side_stream
from fasttrain.step.inductor_setup import compile_function

log = logging.getLogger("fasttrain")


class Evaluator:
    """Eval-mode forward passes, compiled apart from training and optionally CUDA-graphed.

    Eval mode (BN running statistics) is another graph; compiling and capturing it apart leaves
    the training graph untouched, so switching between the two never recaptures either (only
    ``recapture`` does).
    """

    def __init__(
        self,
        model: nn.Module,
        amp_dtype: torch.dtype | None,
        compile: bool,
        batch_size: int,
        *,
        compile_options: dict[str, Any] | None = None,
        cuda_graphs: bool = False,
        dist: DistState | None = None,
    ):
        self.model = model
        self.dist = dist
        self.amp_dtype = amp_dtype
        self.batch_size = batch_size
        self.device_type = next(model.parameters()).device.type
        self.logits = self._logits
        if compile:  # `evaluate` compiles this alone, with no step before it
            # without dynamo's saved trace: evaluation's, saved after training steps, failed
            # to load at the next start on the GPU (compile_function); it is traced at the
            # first evaluation, which inductor's caches still make short
            self.logits = compile_function(
                self._logits, compile_options, what="evaluation", keep_trace=False
            )
        self.cuda_graphs = cuda_graphs and self.device_type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: torch.Tensor | None = None
        self.static_out: torch.Tensor | None = None

    def recapture(self) -> None:
        """Capture the eval forward again at the next evaluation, with the kernels as they are
        then (``late_tuning``'s tuned kernels)."""
        self.graph = None

    def _logits(self, images: torch.Tensor) -> torch.Tensor:
        dtype = self.amp_dtype or torch.float32
        if images.dtype != dtype:  # DALI hands over fp16
            images = images.to(dtype)
        with torch.autocast(self.device_type, dtype=dtype, enabled=self.amp_dtype is not None):
            return self.model(images)

    def _graphed_logits(self, images: torch.Tensor) -> torch.Tensor:
        """Replay the captured eval forward; capture it (after two warm-up calls) on first use."""
        if self.graph is None:
            self.static_in = images.clone(memory_format=torch.preserve_format)
            side = torch.cuda.Stream()
            on_side_stream(lambda: [self.logits(self.static_in) for _ in range(2)], side)
            try:
                self.graph, self.static_out = capture(lambda: self.logits(self.static_in), side)
            except Exception as e:  # report it, then evaluate ungraphed
                self.cuda_graphs = False
                log.warning(
                    "--cuda-graphs: capturing eval failed, so it runs ungraphed: %s", blame(e)
                )
                return self.logits(images)
        self.static_in.copy_(images)
        self.graph.replay()
        return self.static_out

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
                logits = (self._graphed_logits if self.cuda_graphs else self.logits)(images)
                k = min(5, logits.shape[1])
                hits = logits.topk(k, dim=1).indices == labels[:, None]
                batch_counts = torch.stack(
                    (hits[:, 0].sum(), hits.any(dim=1).sum(), (labels >= 0).sum())
                )
                counts = batch_counts if counts is None else counts + batch_counts
        finally:
            self.model.train(was_training)
        if counts is None:  # an empty shard still joins the all-reduce
            counts = torch.zeros(3, dtype=torch.int64, device=next(self.model.parameters()).device)
        if self.dist is not None:  # every rank evaluated its own shard
            self.dist.all_reduce_(counts, what="the all_reduce of the eval counts")
        top1, top5, total = counts.tolist()  # the one host sync of an evaluation
        return {
            "top1": 100.0 * top1 / max(total, 1),
            "top5": 100.0 * top5 / max(total, 1),
            "images": int(total),
        }
