"""Atomic checkpoints and exact resume.

A checkpoint is written to a temporary file in the same directory, flushed, fsynced and renamed
over its final name, then the directory is fsynced: a crash at any point leaves either the old set
of checkpoints or the new one, never a half-written file under a checkpoint's name. Everything in
it loads with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fasttrain.errors import UserError

log = logging.getLogger("fasttrain")
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, newest (highest step) first."""
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """About what one checkpoint takes on disk: the model's state, and SGD's momentum (one fp32
    value per parameter; the optimizer has not made it yet when this is asked, before step 1)."""
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return state + sum(4 * p.numel() for p in model.parameters())


def check_free_space(directory: Path, need: int, keep: int) -> None:
    """Refuse to start when the output directory cannot hold one more checkpoint (a full disk
    found before training, not at the first save); warn when it cannot hold ``keep`` of them."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # a filesystem that will not say: the write probe and the loud save remain
        return
    mib = 2**20
    if free < need:
        raise UserError(
            f"--output-dir {directory}: {free / mib:,.0f} MiB free, and a checkpoint takes about "
            f"{need / mib:,.0f} MiB; free some space or choose another --output-dir"
        )
    if free < need * keep:
        log.warning(
            "--output-dir %s: %.0f MiB free holds fewer than --keep-checkpoints %d checkpoints "
            "of about %.0f MiB; a later save may fail (it will say so and keep the previous one)",
            directory,
            free / mib,
            keep,
            need / mib,
        )


def save_checkpoint(state: dict[str, Any], directory: Path, step: int, keep: int) -> Path:
    """Write ``state`` atomically as ckpt-<step>.pt, then delete all but the newest ``keep``."""
    directory = Path(directory)
    path = checkpoint_path(directory, step)
    tmp = directory / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _read(path: Path) -> dict[str, Any]:
    """Load one checkpoint; raises ``ValueError`` saying what is wrong with it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, not a torch file...
        raise ValueError(
            f"the checkpoint is corrupt or not a fasttrain checkpoint ({type(e).__name__})"
        ) from None
    missing = {"model", "optimizer", "step", "epoch", "loader", "config"} - set(state)
    if missing:
        raise ValueError(f"not a fasttrain checkpoint (missing {', '.join(sorted(missing))})")
    return state


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check the checkpoint ``--resume`` names; a bad file is a ``UserError`` naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--resume {path}: no such checkpoint file")
    try:
        return _read(path)
    except ValueError as e:
        raise UserError(f"--resume {path}: {e}; pick another or start afresh") from None


def latest_valid(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads; corrupt ones are skipped; warned."""
    for path in list_checkpoints(directory):
        try:
            return path, _read(path)
        except ValueError as e:
            log.warning("--resume auto: skipping %s: %s", path, e)
    return None


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch and CUDA RNG states, as tensors and plain values (weights_only-safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
