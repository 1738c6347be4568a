"""GPU microbenchmarks (pytest-benchmark). They skip cleanly without CUDA.

Run on a GPU: ``pytest bench/ --benchmark-json out.json`` (README: Benchmarks).
``--bench-data DIR`` points the loader suite at an ImageFolder tree; by default it builds and uses
the sample dataset (10,000 ImageNet-like JPEGs of about 100 KB, 400x300 to 640x480 pixels).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fasttrain.dist.state import claim_hardware_queues

claim_hardware_queues()  # as the trainer does, before any benchmark starts CUDA


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--bench-data", default=None, help="ImageFolder root for the loader suite")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="GPU benchmarks: no CUDA device")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bench_data(request: pytest.FixtureRequest) -> Path:
    given = request.config.getoption("--bench-data")
    if given:
        return Path(given)
    from fasttrain.config.paths import cache_dir
    from fasttrain.data.sample import build_sample

    return build_sample(cache_dir())
