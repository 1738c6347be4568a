"""Python's bytecode for torch kept where it can be written, so later starts do not compile
torch's source again (no torch here: this runs before torch is imported).

Python imports a module from its cached bytecode (``__pycache__/*.pyc``) when there is one, and
otherwise compiles its source, writing the bytecode for next time unless it may not. Container
images often ship packages without bytecode and set ``PYTHONDONTWRITEBYTECODE=1`` (or install
them read-only): there every process compiles the source of torch, dynamo, inductor and sympy
again, seconds of every start (figures: BENCHMARKS.md, start-up), and again in every compile
worker inductor starts. Where torch's bytecode is missing and would not be written, fasttrain points
Python's ``pycache_prefix`` at ``$FASTTRAIN_CACHE/pycache`` (a mirror tree of bytecode, outside
the packages) and lets it write there. The environment carries the setting to the processes
fasttrain starts (its ranks, inductor's workers). ``FASTTRAIN_PYCACHE=0``, or a
``PYTHONPYCACHEPREFIX`` of the user's own, leaves Python as it is.

Left to the imports, the first start would compile module after module as each is imported, in
the training process and again in each of inductor's compile workers (which start at once and
import the same modules), while the compile needs those CPUs. Instead the first start compiles
the bytecode of torch and the packages a start imports (``PACKAGES``) before importing any of
them, across all the CPUs it may use: under two seconds of CPU per thousand files. A marker keyed
by the interpreter and the packages' locations and install times makes that once per install; a
file lock makes it once when several ranks start together. ``FASTTRAIN_PYCACHE_AHEAD=0`` leaves
it to the imports."""

from __future__ import annotations

import compileall
import fcntl
import importlib.util
import json
import multiprocessing
import os
import py_compile
import sys
import sysconfig
import time
from collections.abc import Iterable, MutableMapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fasttrain.config.paths import cache_dir

# What a training start imports, by import name: torch and the packages it and fasttrain import
# on the way to the first step (a package not installed is passed over), and fasttrain; their
# tests are left out. Of ``SHALLOW`` packages only the top folder: the cuDNN frontend imports a
# dozen of its thousand modules. Under a ``pycache_prefix`` Python reads bytecode only from the
# prefix, so the standard library's is compiled there too (``STDLIB_SKIPPED``: its folders a
# start does not import).
PACKAGES = (
    "torch",
    "sympy",
    "numpy",
    "networkx",
    "triton",
    "torchvision",
    "mpmath",
    "nvidia",
    "cudnn",
    "cutlass",
    "cuda",
    "tensorboard",
    "google",
    "PIL",
    "jinja2",
    "markupsafe",
    "filelock",
    "fsspec",
    "yaml",
    "tqdm",
    "optree",
    "packaging",
    "typing_extensions",
    "fasttrain",
)
STDLIB_SKIPPED = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
    "dist-packages", "__pycache__", "venv", "pydoc_data",
}  # fmt: skip
PACKAGE_SKIPPED = {"tests", "test", "__pycache__"}
SHALLOW = {"cudnn"}
MARKER = "compiled-ahead.json"


def bytecode_missing(package: str = "torch") -> bool:
    """Whether ``package``'s bytecode is neither there nor going to be written by Python."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    if sys.pycache_prefix is not None:  # bytecode already goes to a tree of its own
        return False
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.is_file():
        return False
    if sys.dont_write_bytecode:
        return True
    folder = cached.parent if cached.parent.is_dir() else cached.parent.parent
    return not os.access(folder, os.W_OK)


def keep_bytecode(
    env: MutableMapping[str, str],
    package: str = "torch",
    ahead: Iterable[str] = PACKAGES,
    stdlib: bool = True,
) -> Path | None:
    """Point this process's (and, through ``env``, its children's) bytecode at fasttrain's
    cache where ``package``'s would otherwise be compiled at every start, and compile ``ahead``'s
    (and the standard library's) there now unless ``FASTTRAIN_PYCACHE_AHEAD=0``; the folder, or
    None where nothing changed."""
    if env.get("FASTTRAIN_PYCACHE", "1") == "0" or env.get("PYTHONPYCACHEPREFIX"):
        return None
    if not bytecode_missing(package):
        return None
    prefix = cache_dir() / "pycache"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # no cache folder to write to: Python compiles as before
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    env["PYTHONPYCACHEPREFIX"] = str(prefix)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if env.get("FASTTRAIN_PYCACHE_AHEAD", "1") != "0":
        compile_ahead(prefix, ahead, stdlib=stdlib)
    return prefix


def roots(packages: Iterable[str], stdlib: bool = True) -> tuple[list[tuple], list[list]]:
    """Where the Python files of ``packages`` (and of the standard library) lie, as (a folder
    or file, folders passed over, whether to go below the top), and what identifies the install:
    the interpreter, each package's location and its top file's modification time, which an
    upgrade changes. Imports nothing and reads no folder."""
    found: list[tuple] = []
    key: list[list] = [[sys.version]]
    if stdlib:
        root = sysconfig.get_paths()["stdlib"]
        found.append((root, STDLIB_SKIPPED, True))
        key.append(["stdlib", root])
    for name in packages:
        spec = importlib.util.find_spec(name)  # of a top-level name: imports nothing
        if spec is None:
            continue
        if spec.submodule_search_locations is None:  # a single module
            if spec.origin and spec.origin.endswith(".py"):
                found.append((spec.origin, set(), False))
                key.append([name, spec.origin, os.stat(spec.origin).st_mtime_ns])
            continue
        for root in spec.submodule_search_locations:
            top = os.path.join(root, "__init__.py")
            found.append((root, PACKAGE_SKIPPED, name not in SHALLOW))
            key.append([name, root, os.stat(top).st_mtime_ns if os.path.exists(top) else 0])
    return found, key


def sources(found: Iterable[tuple]) -> list[str]:
    """The Python files under what ``roots`` found."""
    files: list[str] = []
    for root, skipped, deep in found:
        if root.endswith(".py"):
            files.append(root)
            continue
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if deep and d not in skipped and not d.startswith("config-")]
            files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return files


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _compile(paths: list[str]) -> None:
    """Write the bytecode of ``paths`` that is missing or stale, as an import would."""
    for path in paths:
        compileall.compile_file(
            path, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP
        )


def compile_ahead(
    prefix: Path,
    packages: Iterable[str] = PACKAGES,
    workers: int | None = None,
    stdlib: bool = True,
) -> int | None:
    """Compile the bytecode of ``packages`` and the standard library into
    ``sys.pycache_prefix`` (``prefix``), across ``workers`` processes (default: the CPUs this
    process may use), unless the marker in ``prefix`` says it was done for this install.
    Returns the number of files, or None where it was done before."""
    found, key = roots(packages, stdlib)
    marker = prefix / MARKER
    with open(prefix / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several ranks starting together: one compiles
        try:
            if json.loads(marker.read_text()) == key:
                return None
        except (OSError, ValueError):
            pass
        t0 = time.perf_counter()
        files = sources(found)
        workers = workers or usable_cpus()
        print(
            f"fasttrain: compiling the bytecode of torch and its dependencies once, {len(files)} "
            f"files in {workers} processes, into {prefix}",
            file=sys.stderr,
            flush=True,
        )
        if workers > 1:  # before torch is imported: a single thread, so fork is safe
            chunks = [files[i::workers] for i in range(workers)]
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                list(pool.map(_compile, chunks))
        else:
            _compile(files)
        marker.write_text(json.dumps(key))
        print(f"fasttrain: bytecode compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return len(files)
