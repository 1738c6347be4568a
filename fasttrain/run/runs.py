"""Which earlier run ``--resume auto`` continues when no ``--output-dir`` names one: the newest
run under runs/ whose saved config is this one's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fasttrain.config import Config


def newest_run_of(cfg: Config, runs: Path) -> Path | None:
    """The run under ``runs`` with a checkpoint whose saved config is ``cfg``'s (but for what a
    resume may change), the most recently checkpointed first: what ``--resume auto`` without
    ``--output-dir`` continues. The built-in sample set's path is filled in after this, so a
    run without ``--data`` matches runs on the sample set."""
    from fasttrain.run.checkpoint import list_checkpoints

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
    from fasttrain.run.resume import RESUME_MAY_CHANGE

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
