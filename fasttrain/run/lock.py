"""A run owns its folder: a lock file taken before anything is written and released at exit.

Two runs writing one folder (a scheduler's retry beside the first attempt, a second terminal with
the same ``--name``) would write checkpoints of the same names over each other and interleave
their logs. The lock, ``<output-dir>/.lock``, is created exclusively and holds who holds it: the
host, the process and when that process started, and when the run began. A second run is one line
naming the folder and the holder. A lock left by a process that is gone is taken over with a line
that says so, where that can be known: on the same host, where the process (with the start time
it recorded, so a reused process id is not taken for it) no longer exists. A lock held from
another host is never taken without ``--break-lock``. Under several processes rank 0 holds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fasttrain.errors import UserError

NAME = ".lock"


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder."""

    host: str
    pid: int
    pid_started: int | None  # the process's start time in clock ticks since boot (Linux)
    since: str  # when the run began, local time
    command: str

    @classmethod
    def me(cls) -> Holder:
        return cls(
            socket.gethostname(),
            os.getpid(),
            process_started(os.getpid()),
            time.strftime("%Y-%m-%d %H:%M:%S"),
            " ".join(sys.argv),
        )

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}, since {self.since}"

    def gone(self) -> bool | None:
        """Whether the holding process no longer exists: True or False on this host, None on
        another (nothing here can tell)."""
        if self.host != socket.gethostname():
            return None
        started = process_started(self.pid)
        if started is None:
            return not _exists(self.pid)
        return self.pid_started is not None and started != self.pid_started


def process_started(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field); None
    where there is no such process or no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # the fields after the command's name


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """The lock on one run folder, held by this process (``acquire``) until ``release``."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / NAME
        self.held = False

    def acquire(self, break_lock: bool = False) -> str | None:
        """Take the lock, or refuse in one line (``UserError``) naming the folder and who holds
        it. A holder known to be gone is replaced, and so is any holder with ``break_lock``:
        then the line to log about it is returned."""
        me = json.dumps(asdict(Holder.me()))
        note = None
        for _ in range(2):  # a second try after a stale lock is removed
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                note = self._clear(break_lock)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me + "\n")
            self.held = True
            return note
        raise UserError(f"--output-dir {self.path.parent}: could not take its lock ({self.path})")

    def _clear(self, break_lock: bool) -> str:
        """Remove a lock whose holder is gone (or any, with ``break_lock``) and say so; else
        refuse."""
        folder = self.path.parent
        holder = self.holder()
        gone = holder.gone() if holder is not None else None
        if holder is None:  # unreadable: written by a process killed mid-write, or not ours
            note = f"--output-dir {folder}: removed an unreadable lock file {self.path}"
        elif break_lock:
            note = f"--output-dir {folder}: --break-lock took the lock held by {holder.describe()}"
        elif gone:
            note = (
                f"--output-dir {folder}: took over the lock left by {holder.describe()}, which is "
                "gone (it was stopped without releasing it)"
            )
        elif gone is None:
            raise UserError(
                f"--output-dir {folder}: another run holds it ({holder.describe()}, which this "
                "host cannot check); choose another --output-dir, or, if that run is gone, add "
                "--break-lock"
            )
        else:
            raise UserError(
                f"--output-dir {folder}: another run holds it ({holder.describe()}: "
                f"{holder.command}); wait for it to end, or choose another --output-dir or --name"
            )
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return note

    def holder(self) -> Holder | None:
        """Who holds the lock, from its file; None if there is none or it cannot be read."""
        try:
            return Holder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def release(self) -> None:
        """Give the lock up (only if this process holds it)."""
        if self.held:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self.held = False
