"""Loaders alone, side by side: DALI at several ``hw_decoder_load`` values and thread counts,
torchvision with 8 and 16 workers, and synthetic. Each round is one epoch of the train split at
batch 256, 224 px, ending in a device sync; one warm-up epoch first. img/s in ``extra_info``."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from common import loader_args  # bench/common.py

from fasttrain.data.folder import scan_folder

BATCH, SIZE = 256, 224
HAS_DALI = importlib.util.find_spec("nvidia") is not None and (
    importlib.util.find_spec("nvidia.dali") is not None
)


def common() -> dict:
    return loader_args(BATCH, SIZE, torch.device("cuda"))


def run_epochs(benchmark, loader, rounds: int) -> None:
    epoch = iter(range(10**6))

    def one_epoch() -> int:
        loader.set_epoch(next(epoch))
        n = 0
        for x, _ in loader:
            n += x.shape[0]
        torch.cuda.synchronize()
        return n

    images = benchmark.pedantic(one_epoch, rounds=rounds, iterations=1, warmup_rounds=1)
    benchmark.extra_info["images_per_round"] = images
    benchmark.extra_info["img_per_s"] = images / benchmark.stats.stats.median


@pytest.mark.skipif(not HAS_DALI, reason="DALI is not installed")
@pytest.mark.benchmark(group="loaders")
@pytest.mark.parametrize("threads", [4, 8])
@pytest.mark.parametrize("hw_load", [0.0, 0.65, 0.99])
def test_dali(benchmark, bench_data, hw_load, threads):
    from fasttrain.data.dali import build_dali_loader

    samples = scan_folder(bench_data).train
    loader = build_dali_loader(samples, threads=threads, hw_decoder_load=hw_load, **common())
    run_epochs(benchmark, loader, rounds=3)


@pytest.mark.benchmark(group="loaders")
@pytest.mark.parametrize("workers", [8, 16])
def test_torchvision(benchmark, bench_data, workers):
    from fasttrain.data.torchvision import build_torchvision_loader

    samples = scan_folder(bench_data).train
    loader = build_torchvision_loader(samples, workers=workers, dtype=torch.bfloat16, **common())
    run_epochs(benchmark, loader, rounds=2)


@pytest.mark.benchmark(group="loaders")
def test_synthetic(benchmark):
    from fasttrain.data.synthetic import SyntheticLoader

    c = common()
    loader = SyntheticLoader(
        batch_size=BATCH,
        image_size=SIZE,
        num_classes=1000,
        steps=40,
        device=c["device"],
        dtype=torch.bfloat16,
        channels_last=True,
        seed=0,
    )
    run_epochs(benchmark, loader, rounds=5)
