"""The commands besides training: each module holds one command's parser and body, which
``__main__`` dispatches to; ``train`` is the training (and ``evaluate``) command itself."""

import logging
import sys
from pathlib import Path


def say(msg: str) -> None:
    """One line to the user, on stderr, in fasttrain's voice."""
    print(f"fasttrain: {msg}", file=sys.stderr)


def unexpected_failure(run_log: Path | None = None) -> int:
    """A bug or an unforeseen fault: its traceback kept, the run's log named; exit code 1."""
    logging.getLogger("fasttrain").exception("the run failed")
    where = f"; the run's log is {run_log}" if run_log is not None else ""
    say(f"error: an unexpected failure, traceback above{where}")
    return 1
