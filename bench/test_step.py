"""The training step alone (ResNet-50, synthetic bf16 channels_last data, batch 256): eager,
compiled, and each with the whole-step CUDA graph. A round is 25 steps ending in a device sync,
after 30 warm-up steps (compile and capture happen there). img/s in ``extra_info``."""

from __future__ import annotations

import pytest
import torch
from common import make_step  # bench/common.py (pytest puts bench/ on sys.path via rootdir)

BATCH, BLOCK = 256, 25


@pytest.mark.benchmark(group="step")
@pytest.mark.parametrize("kind", ["eager", "compiled", "eager+graph", "compiled+graph"])
def test_step(benchmark, kind):
    one, step, _ = make_step(kind, BATCH)

    def block() -> None:
        for _ in range(BLOCK):
            one()
        torch.cuda.synchronize()

    for _ in range(30):
        one()
    benchmark.pedantic(block, rounds=6, iterations=1, warmup_rounds=1)
    benchmark.extra_info["img_per_s"] = BATCH * BLOCK / benchmark.stats.stats.median
    benchmark.extra_info["capture_failed"] = step.capture_failed
