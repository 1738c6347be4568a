"""The run's folder: ``--output-dir``, or ``runs/<--name or the time>``; with ``--resume auto``
and neither, the newest run under runs/ whose saved config is this one's, which it continues."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from fasttrain.config import Config
from fasttrain.run.checkpoint import list_checkpoints
from fasttrain.run.resume import RESUME_MAY_CHANGE

RUNS = Path("runs")  # where runs go without --output-dir, relative to the working directory


def place_run(cfg: Config, notes: list[str]) -> None:
    """Fill ``--output-dir``, after ``resolve``: a ``--resume auto`` without it or ``--name``
    continues the newest run of this config under runs/ (said in ``notes``), and otherwise a
    new folder is ``runs/<--name, or the time>``."""
    r = cfg.run
    if r.output_dir is None and r.name is None and r.resume == "auto":
        found = newest_run_of(cfg, RUNS)
        if found is not None:
            r.output_dir = str(found)
            notes.append(
                f"--resume auto: continuing {found}, the newest run of this config under runs/ "
                "(--output-dir chooses another)"
            )
    if r.output_dir is None:
        r.output_dir = str(RUNS / (r.name or time.strftime("%Y%m%d-%H%M%S")))


def newest_run_of(cfg: Config, runs: Path) -> Path | None:
    """The run under ``runs`` with a checkpoint whose saved config is ``cfg``'s (but for what a
    resume may change), the most recently checkpointed first: what ``--resume auto`` without
    ``--output-dir`` continues. The built-in sample set's path is filled in after this, so a
    run without ``--data`` matches runs on the sample set."""
    mine = cfg.to_dict()
    candidates = []
    for run in runs.iterdir() if runs.is_dir() else ():
        saved_ckpts = list_checkpoints(run)
        config = run / "config.yaml"
        if not saved_ckpts or not config.is_file():
            continue
        try:
            theirs = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if _same_run(mine, theirs):
            candidates.append((saved_ckpts[0].stat().st_mtime, run))
    return max(candidates)[1] if candidates else None


def _same_run(mine: dict, theirs: Any) -> bool:
    if not isinstance(theirs, dict):
        return False
    sample = mine["data"]["path"] is None  # its path (and list) are known after this
    for section, body in mine.items():
        for key, value in body.items():
            name = f"{section}.{key}"
            if section in RESUME_MAY_CHANGE or name in RESUME_MAY_CHANGE:
                continue
            if sample and name in ("data.path", "data.exclude_list"):
                continue
            if (theirs.get(section) or {}).get(key) != value:
                return False
    return True
