"""The compiled Triton kernels the step runs, kept with a run's compile artifacts.

torch's portable cache artifacts (``compile_cache.Artifacts``) bundle the Triton kernels
compiled while a graph compiles, not the configurations coordinate descent reaches later, at a
kernel's first call or at ``--tune-kernels later``'s tuning step. Inductor's autotune entry then
names a configuration whose binary only the machine that tuned it has: a start on another
machine with those artifacts compiles each tuned kernel again, one after another in the training
process, as it loads the step (``CachingAutotuner``'s ``slow_precompile_config``). So the run
also keeps the Triton cache folders of the kernels its launchers run (each launcher's
``cache_hash`` names its folder in Triton's cache), and a start in that folder puts back any
that Triton's cache lacks before the step is built.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path

log = logging.getLogger("fasttrain")


def triton_dir() -> Path:
    """Triton's cache folder for this process's kernels: ``TRITON_CACHE_DIR``, else the one
    inductor gives Triton for device 0 (every rank compiles for ``cuda:0``,
    ``dist/devices.py``)."""
    given = os.environ.get("TRITON_CACHE_DIR")
    if given:
        return Path(given)
    from torch._inductor.runtime.runtime_utils import triton_cache_dir

    return Path(triton_cache_dir(0))


def launched_kernels() -> set[str]:
    """The Triton cache keys of the launchers of every kernel inductor has loaded in this
    process (the generated modules' ``CachingAutotuner`` objects): after tuning, the tuned
    configurations; before it, the ones the kernels start from."""
    import sys

    if "torch._inductor.codecache" not in sys.modules:  # nothing compiled or loaded
        return set()
    try:
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # a torch without Triton: no Triton kernels
        return set()

    keys: set[str] = set()
    for module in list(PyCodeCache.modules):
        for value in list(vars(module).values()):
            if isinstance(value, CachingAutotuner):
                for launcher in value.launchers:
                    key = getattr(launcher, "cache_hash", None)  # set by every torch that tunes
                    if isinstance(key, str) and key:
                        keys.add(key)
    return keys


def pack(keys: set[str], where: Path) -> tuple[bytes, set[str]]:
    """The folders of ``keys`` in Triton's cache ``where``, as one gzipped tar; with the keys
    found there (a kernel whose folder is missing is left out)."""
    buffer = io.BytesIO()
    found: set[str] = set()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for key in sorted(keys):
            folder = where / key
            if not folder.is_dir():
                continue
            for file in sorted(folder.iterdir()):
                if file.is_file():
                    tar.add(file, arcname=f"{key}/{file.name}", recursive=False)
            found.add(key)
    return buffer.getvalue(), found


def unpack(data: bytes, where: Path) -> tuple[int, set[str]]:
    """Put the packed folders that Triton's cache ``where`` lacks into it; returns how many, and
    the keys packed (put there or found there). A folder is written under a temporary name and
    renamed into place whole, so that a Triton reading the cache beside it never sees half of
    one. Each folder's group files are pointed at its files here (``repointed``). Members other
    than ``<key>/<file>`` regular files are refused (``ValueError``)."""
    where.mkdir(parents=True, exist_ok=True)
    added = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        folders: dict[str, list[tarfile.TarInfo]] = {}
        for member in tar.getmembers():
            parts = member.name.split("/")
            bad = len(parts) != 2 or any(p in ("", ".", "..") for p in parts)
            if bad or not member.isfile():
                raise ValueError(f"unexpected member {member.name!r} in the packed kernels")
            folders.setdefault(parts[0], []).append(member)
        for key, members in folders.items():
            if (where / key).exists():
                continue
            tmp = where / f".{key}.{os.getpid()}.tmp"
            tmp.mkdir(exist_ok=True)
            for member in members:
                source = tar.extractfile(member)
                assert source is not None  # a regular file (checked above)
                name = member.name.split("/")[1]
                (tmp / name).write_bytes(repointed(name, source.read(), where / key))
            try:
                tmp.rename(where / key)
                added += 1
            except OSError:  # another process put it there first
                for file in tmp.iterdir():
                    file.unlink()
                tmp.rmdir()
    return added, set(folders)


def repointed(name: str, content: bytes, folder: Path) -> bytes:
    """A kernel folder's file ``name`` as it belongs in ``folder``: a Triton group file
    (``__grp__<name>.json``) names its kernel's files by absolute path, so a folder packed on
    another machine names that machine's cache, and once that is gone Triton finds the group
    incomplete, misses, and compiles the kernel again (a tuned ResNet's every kernel, as the
    step is loaded). Its paths are pointed at the files of the same names in ``folder``. Any
    other file, or a group file that is not Triton's JSON, is returned as it is."""
    if not (name.startswith("__grp__") and name.endswith(".json")):
        return content
    try:
        group = json.loads(content)
    except ValueError:
        return content
    paths = group.get("child_paths") if isinstance(group, dict) else None
    if not isinstance(paths, dict):
        return content
    here = Path(os.path.abspath(folder))
    group["child_paths"] = {child: str(here / Path(str(p)).name) for child, p in paths.items()}
    return json.dumps(group).encode()
