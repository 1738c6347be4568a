"""A bounded exit: a process that should be ending but is not (a child that will not end, a
thread that will not join, a collective that never returns) prints every thread's stack and
exits 1 instead of holding its machine. No torch here: the program arms it on its way out."""

from __future__ import annotations

import faulthandler
import sys

EXIT_BOUND_S = 60.0  # from the end of main to the end of the process
# from a stop request: time to finish the step (or the evaluation in progress), write the
# checkpoint and leave
STOP_BOUND_S = 600.0


def bound_exit(seconds: float = EXIT_BOUND_S) -> None:
    """Arm the watchdog: if the process is still alive after ``seconds``, print every thread's
    stack and exit 1. Arming again replaces the earlier bound."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


def disarm() -> None:
    faulthandler.cancel_dump_traceback_later()
