"""Atomic checkpoints: writing, listing, finding and loading them (``resume.py``: what they hold).

A checkpoint is written to a temporary file in the same directory, flushed, fsynced and renamed
over its final name, then the directory is fsynced: a crash at any point leaves either the old set
of checkpoints or the new one, never a half-written file under a checkpoint's name. Everything in
it loads with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from fasttrain.config import RunConfig
from fasttrain.errors import CheckpointWriteError, UserError, first_line
from fasttrain.run.weights import NEEDS_CODE, needs_code
from fasttrain.step.training import Training

log = logging.getLogger("fasttrain")
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
WRITER_FAILED = re.compile(r"PytorchStreamWriter failed|file write failed|unexpected pos")


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
        if old != path:  # never the one just written (set_aside keeps later steps away)
            old.unlink(missing_ok=True)
    return path


def set_aside(directory: Path, start_step: int) -> list[Path]:
    """Prepare ``directory`` for a run that starts at ``start_step``: checkpoints of later steps
    belong to a run this one branches away from (a resume from an older step, or a fresh start
    in a used folder). They would win ``--resume auto`` and, newest by step, make pruning delete
    every checkpoint this run writes; they move to ``abandoned-<time>/``. Temporary files of
    writers that died mid-write are removed. Returns the checkpoints moved."""
    directory = Path(directory)
    for tmp in directory.glob(".ckpt-*.pt.tmp-*"):
        tmp.unlink(missing_ok=True)
        log.info("removed %s, left by a checkpoint write that did not finish", tmp.name)
    later = [
        p for p in list_checkpoints(directory) if int(_NAME.match(p.name).group(1)) > start_step
    ]
    if not later:
        return []
    aside = directory / time.strftime("abandoned-%Y%m%d-%H%M%S")
    aside.mkdir(exist_ok=True)
    for path in later:
        os.replace(path, aside / path.name)
    log.warning(
        "this run starts at step %d, and %s held checkpoints of later steps (%s) from a run it "
        "branches away from: moved to %s, so that they neither win --resume auto nor push this "
        "run's checkpoints out",
        start_step,
        directory,
        ", ".join(p.name for p in later),
        aside,
    )
    return later


def _read(path: Path) -> dict[str, Any]:
    """Load one checkpoint; raises ``ValueError`` saying what is wrong with it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, not a torch file...
        if needs_code(e):
            raise ValueError(f"not a fasttrain checkpoint: {NEEDS_CODE}") from None
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


def _first_nonfinite(named: list[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or infinity; None when all are
    finite. Checked where the tensors are (on the device), read with one host copy."""
    floats = [(n, t) for n, t in named if isinstance(t, torch.Tensor) and t.is_floating_point()]
    floats = [(n, t) for n, t in floats if t.numel()]
    if not floats:
        return None
    finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    return next((n for (n, _), ok in zip(floats, finite, strict=True) if not ok), None)


def first_nonfinite(training: Training) -> str | None:
    """The first of the model's parameters and buffers, then the optimizer's state, holding NaN
    or infinity; None when all are finite."""
    named = list(training.model.state_dict().items())
    params = {id(p): n for n, p in training.model.named_parameters()}
    for p, state in training.optimizer.state.items():
        name = params.get(id(p), "a parameter")
        named += [(f"optimizer {key} of {name}", value) for key, value in state.items()]
    return _first_nonfinite(named)


def _finite(state: dict[str, Any]) -> bool:
    """Whether a loaded checkpoint's model and optimizer tensors are all finite."""
    named = list(state["model"].items())
    for i, entry in state["optimizer"].get("state", {}).items():
        named += [(f"optimizer {key} of {i}", value) for key, value in entry.items()]
    return _first_nonfinite(named) is None


def latest_finite(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads and holds only finite values (``--on-nan skip``)."""
    for path in list_checkpoints(directory):
        try:
            state = _read(path)
        except ValueError as e:
            log.warning("--on-nan skip: skipping %s: %s", path, e)
            continue
        if _finite(state):
            return path, state
        log.warning("--on-nan skip: skipping %s: it holds NaN or infinite values", path)
    return None


def write(state: dict[str, Any], run_dir: Path, keep: int) -> Path:
    """``save_checkpoint``, with a failed write (a full disk, a lost mount) as one line that says
    the previous checkpoint is intact."""
    step = state["step"]
    try:
        return save_checkpoint(state, run_dir, step, keep)
    except (OSError, RuntimeError) as e:
        # a full disk reaches torch.save's zip writer as a RuntimeError ("PytorchStreamWriter
        # failed writing file ...: file write failed"); any other RuntimeError is a bug
        if isinstance(e, RuntimeError) and not WRITER_FAILED.search(str(e)):
            raise
        previous = list_checkpoints(run_dir)
        reason = (
            e.strerror
            if isinstance(e, OSError) and e.strerror
            else first_line(str(e), type(e).__name__)
        )
        raise CheckpointWriteError(
            f"could not write the checkpoint of step {step} in {run_dir} ({reason}); "
            + (f"{previous[0].name} is intact" if previous else "no earlier checkpoint exists")
            + ": free space or point --output-dir elsewhere, then --resume auto"
        ) from None


def find_resume(run: RunConfig) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``--resume`` names (or the newest valid one, for 'auto'), loaded."""
    if run.resume is None:
        return None
    if run.resume == "auto":
        found = latest_valid(run.output_dir)
        return (str(found[0]), found[1]) if found is not None else None
    return run.resume, load_checkpoint(run.resume)
