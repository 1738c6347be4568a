"""The CUDA libraries read into memory ahead of their first use, while the start imports and
compiles (no torch here: this runs before torch is imported).

cuDNN and cuBLAS load each kernel from their library files the first time it runs (CUDA's lazy
loading), so the first step reads from the libraries, a few gigabytes, whatever it needs. Where
the files are not in the page cache (a machine that has not run torch since it booted, a node
whose environment lies on a network filesystem) those reads come from the disk, one kernel at a
time, inside the first step: seconds of it (BENCHMARKS.md, start-up). Before that step the
start spends tens of seconds compiling, with the disk idle. So a thread asks the kernel to read
the libraries now (``posix_fadvise(POSIX_FADV_WILLNEED)``, which queues the reads and returns),
those the first step uses first. Where the files are cached already, that is a system call per
file. ``FASTTRAIN_READAHEAD=0`` turns it off.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping
from pathlib import Path

# The libraries' folders, by the package that holds them (CUDA 13's wheels put CUDA's own
# libraries in one folder, CUDA 12's in one each), in the order the first step needs them: cuDNN
# (the convolutions), cuBLAS, NVRTC and nvJitLink (cuDNN's runtime-compiled kernels), torch's,
# NCCL, then DALI's. Of them only the libraries named in ``NAMES``: not the FFTs, sparse and
# solver libraries torch also links.
FOLDERS = (
    ("nvidia", "cudnn/lib"),
    ("nvidia", "cu13/lib"),
    ("nvidia", "cublas/lib"),
    ("nvidia", "cuda_nvrtc/lib"),
    ("nvidia", "nvjitlink/lib"),
    ("torch", "lib"),
    ("nvidia", "nccl/lib"),
    ("nvidia", "dali"),
    ("nvidia", "nvimgcodec"),
)
NAMES = (
    "cudnn", "cublas", "nvrtc", "nvJitLink", "torch", "c10", "nccl", "dali", "nvjpeg", "nvimgcodec",
)  # fmt: skip
FIRST = ("cudnn", "cublas", "nvrtc", "torch_cuda")  # within a folder, these first


def library_files(folders: tuple[tuple[str, str], ...] = FOLDERS) -> list[Path]:
    """The shared libraries under ``folders`` (package, folder within it), each once, in the
    order of ``folders`` and, within one, the libraries named in ``FIRST`` first."""
    files: list[Path] = []
    seen: set[Path] = set()
    for package, sub in folders:
        spec = importlib.util.find_spec(package)  # of a top-level name: imports nothing
        if spec is None or spec.submodule_search_locations is None:
            continue
        for root in spec.submodule_search_locations:
            folder = Path(root) / sub
            if not folder.is_dir():
                continue
            found = [
                p
                for p in folder.rglob("*.so*")
                if p.is_file() and p not in seen and any(n in p.name for n in NAMES)
            ]
            found.sort(key=lambda p: (not any(n in p.name for n in FIRST), p.name))
            seen.update(found)
            files += found
    return files


def read_ahead(files: list[Path]) -> int:
    """Ask the kernel to read ``files`` into the page cache; returns the bytes asked for."""
    asked = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            asked += size
        except OSError:
            pass
        finally:
            os.close(fd)
    return asked


def start_read_ahead(env: Mapping[str, str]) -> threading.Thread | None:
    """Read the CUDA libraries ahead on a daemon thread; None where turned off or where the
    system has no ``posix_fadvise``."""
    if env.get("FASTTRAIN_READAHEAD", "1") == "0" or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(
        target=lambda: read_ahead(library_files()), name="fasttrain-readahead", daemon=True
    )
    thread.start()
    return thread
