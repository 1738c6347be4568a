"""Python's bytecode for torch kept where it can be written, so later starts do not compile
torch's source again (no torch here: this runs before torch is imported).

Python imports a module from its cached bytecode (``__pycache__/*.pyc``) when there is one, and
otherwise compiles its source, writing the bytecode for next time unless it may not. Container
images often ship packages without bytecode and set ``PYTHONDONTWRITEBYTECODE=1`` (or install
them read-only): there every process compiles the source of torch, dynamo, inductor and sympy
again, seconds of every start (figures: BENCHMARKS.md, start-up), and again in every compile
worker inductor starts. Where torch's bytecode is missing and would not be written, fasttrain points
Python's ``pycache_prefix`` at ``$FASTTRAIN_CACHE/pycache`` (a mirror tree of bytecode, outside
the packages) and lets it write there: the first start writes it, later ones read it. The
environment carries the setting to the processes fasttrain starts (its ranks, inductor's
workers). ``FASTTRAIN_PYCACHE=0``, or a ``PYTHONPYCACHEPREFIX`` of the user's own, leaves Python
as it is."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from fasttrain.config.paths import cache_dir


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


def keep_bytecode(env: MutableMapping[str, str], package: str = "torch") -> Path | None:
    """Point this process's (and, through ``env``, its children's) bytecode at fasttrain's
    cache where ``package``'s would otherwise be compiled at every start; the folder, or None
    where nothing changed."""
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
    return prefix
