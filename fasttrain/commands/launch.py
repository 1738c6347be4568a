"""``--nproc-per-node N``: N processes on this machine through torch.distributed.run."""

from __future__ import annotations

import os

from fasttrain.commands import say
from fasttrain.errors import UserError


def take_count(argv: list[str], flag: str) -> tuple[int | None, list[str]]:
    """``flag N`` (or ``flag=N``) taken out of ``argv``: (N, the rest); (None, argv) where it is
    not given. N must be a positive whole number."""
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(f"{flag}="):
            value = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            break
    else:
        return None, argv
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{flag} {value!r}: expected a positive whole number")
    return int(value), rest


def launch(argv: list[str]) -> int | None:
    """``--nproc-per-node N``: start N copies of this command through torch.distributed.run
    (torchrun's own code: rendezvous, environment, elastic agent). None if not asked for."""
    value, rest = take_count(argv, "--nproc-per-node")
    if value is None:
        return None
    if "LOCAL_RANK" in os.environ:
        raise UserError("--nproc-per-node: this process was already launched by torchrun")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", f"--nproc-per-node={value}", "-m", "fasttrain", *rest])
    except SignalException as e:  # preempted: torchrun passed the signal on and waited
        say(
            f"stopped by {e.sigval.name}; each process checkpointed before exiting "
            "(see log-rank<N>.txt): the same command with --resume auto continues"
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        say(f"a training process failed (exit code {_first_exit(e)}); its log is above")
        return _first_exit(e) or 1
    return 0


def _first_exit(e) -> int:
    for failure in e.failures.values():
        return int(failure.exitcode) if failure.exitcode > 0 else 1
    return 1
