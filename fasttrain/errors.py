"""Errors a user can act on: one line, an exit code, no traceback (see ``__main__``)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a flag, config key, dataset or checkpoint the user must fix.

    The message names the file or flag and what to do; ``__main__`` prints it on one line and
    exits with ``exit_code`` (2 for bad input; subclasses for runtime faults use 1).
    """

    exit_code = 2
