"""Errors a user can act on: one line, an exit code, no traceback (``__main__`` prints them).
The exit codes are listed once, in docs/RELIABILITY.md.
"""

from __future__ import annotations


def first_line(text: str, default: str = "") -> str:
    """The first non-blank line of an error's text, stripped: what a one-line message quotes."""
    return next((x.strip() for x in text.splitlines() if x.strip()), default)


class UserError(Exception):
    """Bad input: the message names the file or flag and what to do."""

    exit_code = 2


class RuntimeFault(UserError):
    """Something went wrong while training, not in the input: still one line, exit code 1."""

    exit_code = 1


class OutOfMemory(RuntimeFault):
    pass


class CheckpointWriteError(RuntimeFault):
    pass


class NonFiniteLoss(UserError):
    exit_code = 3
