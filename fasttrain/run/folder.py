"""The run's folder: created and probed, locked for this run (``lock.py``), its logs started and
the resolved config saved; given up at the end, or removed when the run could not start."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from fasttrain.config import Config
from fasttrain.config.cli import save_resolved
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.run.lock import RunLock
from fasttrain.run.runtime import detach_logging, setup_logging

log = logging.getLogger("fasttrain")


@dataclass
class RunFolder:
    """A run's folder, held for the run (``release`` when it ends)."""

    path: Path
    created: bool  # by this run: ``discard`` may remove it
    lock: RunLock | None  # rank 0 holds it; None on the other ranks

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def discard(self, dist: DistState) -> None:
        """Remove a folder this run created for a start that failed: its config and log say
        nothing the one-line error has not, and a folder per failed start would pile up."""
        self.release()
        if not self.created:
            return
        detach_logging()
        (self.path / f"log-rank{dist.rank}.txt").unlink(missing_ok=True)
        if dist.is_main:
            (self.path / "config.yaml").unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only if nothing else is in it (another rank's log)
            self.path.rmdir()


def open_run_folder(cfg: Config, dist: DistState) -> RunFolder:
    """Create and probe ``--output-dir``, take its lock (rank 0; every rank hears if that
    failed), start logging and save the resolved config."""
    out = Path(cfg.run.output_dir)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{dist.rank}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"--output-dir {out}: cannot write there ({e.strerror}); choose a writable directory"
        ) from None
    lock, refused, note = None, None, None
    if dist.is_main:
        lock = RunLock(out)
        try:
            note = lock.acquire(cfg.run.break_lock)
        except UserError as e:
            refused = str(e)
    refused = dist.all_gather_object(refused, "the gather of the run folder's lock")[0]
    if refused is not None:
        raise UserError(refused)
    folder = RunFolder(out, created, lock)
    setup_logging(out, dist)
    if note is not None:
        log.warning("%s", note)
    if dist.is_main:
        save_resolved(cfg, out / "config.yaml")
    return folder
