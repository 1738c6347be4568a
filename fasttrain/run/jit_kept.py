"""CUDA's JIT cache kept with a run and in the compile cache, for a start on a machine whose own
is empty.

On a machine that has not run them, the CUDA driver compiles some of cuDNN's kernels from PTX at
their first use and keeps the result in its JIT cache (``$CUDA_CACHE_PATH``, else
``~/.nv/ComputeCache``). A resume on a new machine, which loads its step compiled, then waits
mostly for that (cuDNN's convolutions ahead, ``step/conv_warmup.py``), and so does every new node
of a job that shares its compile cache. So the main process keeps the machine's JIT cache, where
it is small (``CAP``), in the run's folder (``compile-cache/cuda-jit-<machine>.tar.gz``) and in
the compile cache's directory (``cuda-jit/<machine>.tar.gz``) after its first step, again when it
has grown; and a start whose machine's JIT cache is empty puts one back before any CUDA work,
whole or not at all. ``<machine>`` is the NVIDIA driver's version and the GPUs' models, so a
copy never meets another driver (CUDA invalidates its JIT cache when the driver changes).
``FASTTRAIN_JIT_KEPT=0`` turns both off.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import tarfile
from collections.abc import Mapping
from pathlib import Path

from fasttrain.files import write_whole
from fasttrain.step.conv_warmup import jit_cache_path

log = logging.getLogger("fasttrain")

CAP = 64 * 2**20  # a cache larger than this (other programs' kernels too) is not kept
DRIVER = Path("/proc/driver/nvidia")
OFF = "FASTTRAIN_JIT_KEPT"  # "0": neither kept nor put back


def machine_key(driver: Path) -> str | None:
    """The driver's version line and the GPUs' models, hashed; None without NVIDIA's driver."""
    try:
        parts = [(driver / "version").read_text().splitlines()[0]]
    except (OSError, IndexError):
        return None
    for info in sorted((driver / "gpus").glob("*/information")):
        try:
            parts += [x for x in info.read_text().splitlines() if x.startswith("Model:")]
        except OSError:
            continue
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def listing(cache: Path) -> list[tuple[Path, int]]:
    """The files under ``cache``, sorted, with their sizes: their count and total tell that it
    grew, and ``pack`` writes them."""
    if not cache.is_dir():
        return []
    return [(p, p.stat().st_size) for p in sorted(cache.rglob("*")) if p.is_file()]


def pack(cache: Path, cap: int = CAP, files: list[tuple[Path, int]] | None = None) -> bytes | None:
    """The files under ``cache`` (``files``: its ``listing``, if already read), as one gzipped
    tar; None where there are none or they come to more than ``cap`` bytes."""
    files = listing(cache) if files is None else files
    if not files or sum(size for _, size in files) > cap:
        return None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for file, _ in files:
            tar.add(file, arcname=file.relative_to(cache).as_posix(), recursive=False)
    return buffer.getvalue()


def unpack(data: bytes, cache: Path) -> int:
    """Make ``cache``, missing or empty, the packed JIT cache; returns how many files, 0 where
    ``cache`` already held something. It is written under a temporary name and renamed into
    place whole, so that neither the driver nor another rank starting beside this one ever sees
    half of it. Members other than relative paths of regular files and folders are refused
    (``ValueError``)."""
    if cache.is_dir() and any(cache.iterdir()):
        return 0
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.parent / f".{cache.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if member.name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                    raise ValueError(f"unexpected member {member.name!r} in the JIT cache")
                if member.isdir():
                    (tmp / member.name).mkdir(parents=True, exist_ok=True)
                    continue
                if not member.isfile():
                    raise ValueError(f"unexpected member {member.name!r} in the JIT cache")
                source = tar.extractfile(member)
                assert source is not None  # a regular file (checked above)
                (tmp / member.name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / member.name).write_bytes(source.read())
                count += 1
        if cache.is_dir():
            cache.rmdir()  # empty (checked above); fails if something came meanwhile
        tmp.rename(cache)
    except OSError:  # another rank or the driver put something there first
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count


def places(
    run_kept: Path | None, compile_root: Path | None, driver: Path | None = None
) -> list[Path]:
    """Where the JIT cache is kept for this machine (module notes): the run's folder first
    (``run_kept``: its folder of compile artifacts, ``compile_cache.FOLDER``), then the compile
    cache's directory; none without NVIDIA's driver (``driver``: its ``/proc`` folder,
    ``DRIVER``)."""
    machine = machine_key(driver or DRIVER)
    if machine is None:
        return []
    found = []
    if run_kept is not None:
        found.append(run_kept / f"cuda-jit-{machine}.tar.gz")
    if compile_root is not None:
        found.append(compile_root / "cuda-jit" / f"{machine}.tar.gz")
    return found


def restore(kept: list[Path], env: Mapping[str, str]) -> Path | None:
    """Make the machine's JIT cache, which the caller found empty at the process's start, the
    first kept one found in ``kept``; the one it used, or None. Call it before any CUDA work."""
    cache = jit_cache_path(env)
    if cache is None or env.get(OFF) == "0":
        return None
    for place in kept:
        if not place.is_file():
            continue
        try:
            count = unpack(place.read_bytes(), cache)
        except (OSError, ValueError, tarfile.TarError) as e:
            log.warning("CUDA's JIT cache kept in %s not used (%s)", place, e)
            continue
        # 0: the machine's cache is no longer empty (another rank's start), and stays as it is
        return place if count else None
    return None


class JitKept:
    """Keeps the machine's JIT cache in ``kept`` (``places``) from the main process, where it has
    grown since the last save and is no larger than ``CAP``."""

    def __init__(self, kept: list[Path], env: Mapping[str, str], is_main: bool):
        self.kept = kept if env.get(OFF) != "0" else []
        self.cache = jit_cache_path(env)
        self.is_main = is_main
        self.saved: tuple[int, int] | None = None

    def save(self) -> None:
        if not (self.is_main and self.kept and self.cache is not None):
            return
        try:  # the driver may write or remove files meanwhile: a failure only skips this save
            files = listing(self.cache)
            now = (len(files), sum(size for _, size in files))
            if now == self.saved or not files:
                return
            data = pack(self.cache, files=files)
        except (OSError, tarfile.TarError) as e:
            log.debug("CUDA's JIT cache not kept: %s", e)
            return
        self.saved = now
        if data is None:
            log.debug("CUDA's JIT cache not kept: more than %d MB", CAP // 2**20)
            return
        for place in self.kept:
            try:
                write_whole(place, data)
            except OSError as e:
                log.debug("CUDA's JIT cache not kept in %s: %s", place, e)
