"""`python -m fasttrain env`: the hardware and software a run depends on, in one report."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess

import torch


def _version(dist_name: str, module: str) -> str:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "not installed"
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
    except ModuleNotFoundError:
        return "not installed"
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "installed (version unknown)"


def _dali_version() -> str:
    from fasttrain.data.dali_install import installed_dali_builds

    builds = installed_dali_builds()
    if builds:  # every pip-installed build: two at once is a problem the report should show
        return ", ".join(f"{version} ({name})" for name, version in builds.items())
    try:
        import nvidia.dali as dali  # e.g. unpacked onto PYTHONPATH without package metadata

        return dali.__version__
    except ImportError:
        return "not installed"


def _topology() -> str:
    """nvidia-smi's matrix where it exists; otherwise peer access as torch sees it."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    n = torch.cuda.device_count()
    if n < 2:
        return "single GPU" if n == 1 else "no GPUs"
    rows = [
        f"GPU{i}: peer access to "
        + ", ".join(
            f"GPU{j}={'yes' if torch.cuda.can_device_access_peer(i, j) else 'no'}"
            for j in range(n)
            if j != i
        )
        for i in range(n)
    ]
    return "\n".join(rows)


def _cudnn_version(code: int) -> str:
    """cuDNN's version number as it is written: 92400 -> 9.24.0 (cuDNN 9 packs major x 10000 +
    minor x 100 + patch; cuDNN 8, major x 1000 + minor x 100 + patch)."""
    if code >= 90000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def env_report() -> str:
    lines = [
        f"python       {platform.python_version()} ({platform.platform()})",
        f"cpu cores    {len(os.sched_getaffinity(0))} usable of {os.cpu_count()}",
        f"torch        {torch.__version__}",
        f"torchvision  {_version('torchvision', 'torchvision')}",
        f"CUDA         {torch.version.cuda or 'none (CPU build)'}",
    ]
    cudnn = (
        _cudnn_version(torch.backends.cudnn.version())
        if torch.backends.cudnn.is_available()
        else "n/a"
    )
    lines.append(f"cuDNN        {cudnn}")
    lines.append(f"cuDNN front  {_version('nvidia-cudnn-frontend', 'cudnn')}")
    try:
        nccl = (
            ".".join(map(str, torch.cuda.nccl.version()))
            if torch.cuda.is_available()
            else "n/a (no GPU)"
        )
    except (AttributeError, RuntimeError):
        nccl = "n/a"
    lines.append(f"NCCL         {nccl}")
    lines.append(f"triton       {_version('triton', 'triton')}")
    lines.append(f"DALI         {_dali_version()}")
    from fasttrain.data.dali_install import dali_cuda_mismatch

    mismatch = dali_cuda_mismatch(torch.version.cuda)
    if mismatch:
        lines.append(f"  warning: {mismatch}")
    from fasttrain.dist.state import HW_QUEUES_ENV

    lines.append(f"CUDA queues  {HW_QUEUES_ENV}={os.environ.get(HW_QUEUES_ENV, 'unset (8)')}")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        lines.append(f"GPUs         {n}")
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            lines.append(
                f"  GPU{i}       {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"
            )
        lines.append("topology")
        lines.extend("  " + row for row in _topology().splitlines())
    else:
        lines.append("GPUs         none visible (torch.cuda.is_available() is False)")
    return "\n".join(lines)
