"""--batch-size auto: the search on the CPU, and its measured trials on a GPU (``gpu``)."""

import pytest
import torch

from fasttrain.run.autobatch import LIMIT, MULTIPLE, search
from fasttrain.step.plan import Plan

GPU = torch.device("cuda")


@pytest.mark.parametrize("capacity", [8, 9, 63, 64, 100, 1000, 2999, 3000, 5000])
def test_search_finds_the_largest_fitting_multiple_of_8_within_6_percent(capacity):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= capacity

    found = search(fits)
    assert found <= capacity and found % MULTIPLE == 0
    assert capacity - found < max(MULTIPLE, capacity / 16)
    assert len(tried) <= 14  # doublings and a short bisection: about a minute of trials
    assert fits(found) and not fits(found + max(MULTIPLE, found // 16 // 8 * 8) + MULTIPLE)


def test_search_returns_0_when_nothing_fits_and_the_limit_when_everything_does():
    assert search(lambda b: False) == 0
    assert search(lambda b: True) == LIMIT
    assert search(lambda b: True, limit=1000) == 512  # doublings from 64 that stay under it


def test_auto_measures_each_train_size_largest_first_and_keeps_the_larger_batches(monkeypatch):
    """Under --progressive-resizing every size is searched, the largest first, each smaller one
    from the batch found above it; sizes that fit more than the largest keep their own."""
    import torch

    from fasttrain.config import Config
    from fasttrain.config.parse import Parsed
    from fasttrain.dist.state import DistState
    from fasttrain.run import autobatch
    from fasttrain.run.autobatch import Found, auto_batch_size

    searched = []

    def fake_find(build, device, limit=LIMIT, start=64):
        size = build(0)  # the fake builder below answers with the size it was made for
        searched.append((size, start))
        batch = {224: 512, 192: 704, 160: 1024}[size]  # fewer pixels, a larger batch
        return Found(batch, 0, 1, [(batch, 0)], 0.0)

    def sized_builder(make_training, image_size, *args, **kwargs):
        return lambda batch: image_size

    monkeypatch.setattr(autobatch, "find_batch_size", fake_find)
    monkeypatch.setattr(autobatch, "step_builder", sized_builder)
    cfg = Config()
    cfg.data.progressive_resizing, cfg.train.epochs, cfg.train.amp = "160:224:2:6", 8, "bf16"
    cfg.train.triton_kernels = "none"
    cfg.parsed = Parsed.of(cfg)
    dist = DistState(0, 0, 1, torch.device("cpu"))
    assert auto_batch_size(cfg, dist, None) == (512, {160: 1024, 192: 704})
    assert searched == [(224, 64), (192, 512), (160, 704)]
    saved = {"config": {"train": {"batch_size": 512, "batch_sizes": "160:1024,192:704"}}}
    assert auto_batch_size(cfg, dist, ("ckpt.pt", saved)) == (512, {160: 1024, 192: 704})


@pytest.mark.gpu
def test_auto_batch_size_settles_within_what_is_free():
    """With all but a few GiB of the GPU taken, the search settles on a batch whose real step
    (warm-up and graph capture included) peaks within the budget, after a larger one failed."""
    from fasttrain.config import Config
    from fasttrain.config.parse import Parsed
    from fasttrain.dist.state import DistState
    from fasttrain.run.autobatch import HEADROOM, find_batch_size, step_builder
    from fasttrain.run.build import build_training

    cfg = Config()  # ResNet-50, eager, bf16, channels_last, graphed
    cfg.train.amp, cfg.train.cuda_graphs, cfg.train.triton_kernels = "bf16", True, "none"
    cfg.parsed = Parsed.of(cfg)
    dist = DistState(0, 0, 1, GPU)

    def make_training():
        return build_training(
            cfg, dist, num_classes=10, plan=Plan.uniform(100, 256, 1), parallel=False
        )

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    blocker = torch.empty(free - int(HEADROOM * total) - 6 * 2**30, dtype=torch.uint8, device=GPU)
    try:
        build = step_builder(
            make_training,
            224,
            10,
            torch.bfloat16,
            True,
            GPU,
            steps=5,
        )
        found = find_batch_size(build, GPU)
    finally:
        del blocker
        torch.cuda.empty_cache()
    print(f"auto batch {found.batch}: {found.trials}")
    assert found.batch >= 8 and found.batch % 8 == 0
    assert 0 < found.peak_bytes <= found.budget_bytes <= 6.5 * 2**30
    assert any(b > found.batch and (p is None or p > found.budget_bytes) for b, p in found.trials)
