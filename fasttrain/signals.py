"""Preemption: the first SIGTERM or SIGINT asks the loop to finish its step, checkpoint and exit
0 (what torchrun's elastic restarts and cluster schedulers expect); a second one exits at once.

The handler only sets a flag; the loop reads it between steps (in one process) or at log steps
(several processes, where the ranks agree on it in the log step's collective, so they all stop
after the same step).
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

log = logging.getLogger("fasttrain")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # the second signal: no checkpoint, now
            os._exit(128 + signum)
        self.signum = signum
        log.warning(
            "%s: finishing the current step, then writing a checkpoint and exiting (send it "
            "again to exit at once)",
            signal.Signals(signum).name,
        )
