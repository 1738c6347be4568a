"""Fixtures of the step tests."""

from __future__ import annotations

import pytest

from tests.step.kernel_source import NAME, SOURCE


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """kernel_source's kernel, loaded as inductor loads it (for sm_90), with fresh caches."""
    from torch._inductor.codecache import PyCodeCache

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a JITFunction, as on a GPU (none compiles)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return getattr(PyCodeCache.load(SOURCE), NAME)
