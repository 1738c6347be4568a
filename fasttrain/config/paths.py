"""Where fasttrain finds its recipes and keeps what it generates (no torch: the CLI reads it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def config_dir() -> Path:
    """The built-in recipes: configs/ in a source checkout, else the installed package data."""
    repo = Path(__file__).resolve().parents[2] / "configs"
    if repo.is_dir():
        return repo
    from importlib.resources import files

    return Path(str(files("fasttrain.configs")))


def cache_dir() -> Path:
    """Where the sample dataset and other generated files live: $FASTTRAIN_CACHE or ~/.cache."""
    env = os.environ.get("FASTTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fasttrain"


def default_exclude_list(data_path: str | Path) -> Path:
    """Where ``check-data`` writes, and training looks for, the bad-file list of a dataset
    (0.1.0 wrote it as text under the same name with ``.txt``: ``found_exclude_list`` reads
    either)."""
    absolute = os.path.abspath(Path(data_path).expanduser())
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:12]
    return cache_dir() / "check-data" / f"{Path(absolute).name}-{digest}.json"


def found_exclude_list(data_path: str | Path) -> Path | None:
    """The bad-file list check-data wrote for ``data_path``, if there is one."""
    path = default_exclude_list(data_path)
    return next((p for p in (path, path.with_suffix(".txt")) if p.is_file()), None)
