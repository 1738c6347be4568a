"""Errors a user can act on: one line, an exit code, no traceback (``__main__`` prints them).

Exit codes: 2 bad input (a flag, config key, dataset or checkpoint to fix); 1 a runtime fault
(out of memory, a failed checkpoint write, an undecodable file DALI stopped on, a collective that
timed out); 3 a non-finite loss under ``--on-nan stop``; 128 + N a second stop signal N.
"""

from __future__ import annotations


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
