"""Preemption: the first SIGTERM or SIGINT asks the loop to finish its step, checkpoint and exit
0 (what torchrun's elastic restarts and cluster schedulers expect); a second one exits at once.

"Second" means at least ``REPEAT_WINDOW_S`` after the first: a scheduler that signals the whole
process group and torchrun forwarding the same signal to its workers deliver it twice within
milliseconds, and that must not cost the checkpoint.

The handler only sets a flag; the loop reads it between steps (in one process) or at log steps
(several processes, where the ranks agree on it in the log step's collective, so they all stop
after the same step).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from types import FrameType

log = logging.getLogger("fasttrain")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class StopRequest:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.first_at = 0.0
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
        if self.requested:
            if time.monotonic() - self.first_at < REPEAT_WINDOW_S:
                return  # the same request delivered twice (process group + torchrun)
            os._exit(128 + signum)  # a second request: no checkpoint, now
        self.signum = signum
        self.first_at = time.monotonic()
        log.warning(
            "%s: finishing the current step, then writing a checkpoint and exiting (send it "
            "again to exit at once)",
            signal.Signals(signum).name,
        )
