"""Which DALI is installed, and whether it suits torch: DALI ships one PyPI package per CUDA
major version, all of them the same ``nvidia.dali`` module. Imports no DALI, so ``env`` and
``resolve`` can ask without loading it."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from collections.abc import Collection

from fasttrain.errors import UserError

# DALI's builds on PyPI by the CUDA major version they are built for; fasttrain depends on the
# CUDA 13 one (as PyPI's torch is built), the other is the choice for a CUDA 12 torch
DALI_BUILDS = {"13": "nvidia-dali-cuda130", "12": "nvidia-dali-cuda120"}
INSTALL_DALI = (
    "pip install nvidia-dali-cuda130 (for a CUDA 13 torch) or nvidia-dali-cuda120 (CUDA 12)"
)


def dali_available() -> bool:
    return importlib.util.find_spec("nvidia") is not None and (
        importlib.util.find_spec("nvidia.dali") is not None
    )


def require_dali() -> None:
    if not dali_available():
        raise UserError(f"--loader dali: NVIDIA DALI is not installed; {INSTALL_DALI}")


def installed_dali_builds() -> dict[str, str]:
    """The DALI packages pip installed (any CUDA major): name -> version."""
    found = {}
    for name in (*DALI_BUILDS.values(), "nvidia-dali-cuda110"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def dali_cuda_mismatch(torch_cuda: str | None, builds: Collection[str] | None = None) -> str | None:
    """A one-line warning when the DALI installed is built for another CUDA major version than
    torch (``torch.version.cuda``), or when two builds share the ``nvidia.dali`` module; None
    when they agree, or without a CUDA torch or a pip-installed DALI."""
    builds = installed_dali_builds() if builds is None else builds
    if not torch_cuda or not builds:
        return None
    major = torch_cuda.split(".")[0]
    want = DALI_BUILDS.get(major)
    others = [b for b in builds if b != want]
    if not others:
        return None
    swap = f"pip uninstall -y {' '.join(others)}"
    if want in builds:
        return (
            f"DALI: {', '.join(builds)} are installed and share one module; torch is built for "
            f"CUDA {major}, so keep {want}: {swap}, then pip install --force-reinstall {want}"
        )
    fix = f"{swap} && pip install {want}" if want else swap
    return (
        f"DALI ({', '.join(others)}) is built for another CUDA major version than torch "
        f"(CUDA {torch_cuda}); its GPU decode may fail to load: {fix}"
    )
