"""Entry point.

- ``python -m fasttrain [flags]`` trains.
- ``python -m fasttrain env`` reports the hardware and software.
- ``python -m fasttrain check-data DIR`` lists undecodable images and writes the list loaders skip.
- ``python -m fasttrain profile-summary TRACE_DIR`` recomputes the step breakdown from traces.
- ``python -m fasttrain evaluate WEIGHTS [flags]`` evaluates weights on a val set
  (``--test-only --weights WEIGHTS``: the training flags apply).
- ``python -m fasttrain export CHECKPOINT OUT`` writes a checkpoint's weights as a state dict.
- ``python -m fasttrain compile [--nproc-per-node N] [--nnodes M] [flags]`` compiles, in one
  process, what every process of a job with those flags compiles, into its compile cache.

Each command is a module of ``fasttrain.commands``; this file dispatches. A ``UserError``
anywhere becomes one line on stderr and its exit code.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence

from fasttrain.run.watchdog import bound_exit

# the commands besides training, by name: their modules under fasttrain.commands
SUBCOMMANDS = {
    "env": None,
    "check-data": "check_data",
    "profile-summary": "profile_summary",
    "export": "export",
    "compile": "compile",
}


def evaluate_argv(argv: list[str]) -> list[str]:
    """``evaluate WEIGHTS [flags]`` as the trainer's flags: ``--test-only --weights WEIGHTS``."""
    if argv[:1] and not argv[0].startswith("-"):
        return ["--test-only", "--weights", argv[0], *argv[1:]]
    return ["--test-only", *argv]


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["evaluate"]:
        argv = evaluate_argv(argv[1:])
    if not (argv[:1] and argv[0] in SUBCOMMANDS) and ("-h" in argv or "--help" in argv):
        from fasttrain.config.cli import build_parser

        build_parser().print_help()  # before torch is imported: --help answers at once
        return 0
    from fasttrain.pycache import keep_bytecode

    keep_bytecode(os.environ)  # before torch is imported: its bytecode, not its source, each start
    from fasttrain.dist.devices import one_gpu_per_rank
    from fasttrain.dist.state import claim_hardware_queues

    claim_hardware_queues()  # before CUDA starts; torchrun's workers inherit it
    one_gpu_per_rank(os.environ)  # before CUDA starts: each rank compiles for cuda:0
    from fasttrain.commands import unexpected_failure
    from fasttrain.errors import UserError

    if argv[:1] == ["env"]:
        from fasttrain.envreport import env_report

        print(env_report())
        return 0
    try:
        if argv[:1] and argv[0] in SUBCOMMANDS:
            command = importlib.import_module(f"fasttrain.commands.{SUBCOMMANDS[argv[0]]}")
            return command.main(argv[1:])
        from fasttrain.commands.launch import launch

        launched = launch(argv)
        if launched is not None:
            return launched
        from fasttrain.commands import train

        return train.main(argv, t_start)
    except UserError as e:
        print(f"fasttrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug or an unforeseen fault in a command: keep its traceback
        return unexpected_failure()


def entry() -> None:
    """The program: ``main``, then an exit bounded in time (``watchdog.bound_exit``)."""
    code = main()
    bound_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry()
