"""Entry point.

- ``python -m fasttrain [flags]`` trains.
- ``python -m fasttrain env`` reports the hardware and software.
- ``python -m fasttrain check-data DIR`` lists undecodable images and writes the list loaders skip.
- ``python -m fasttrain profile-summary TRACE_DIR`` recomputes the step breakdown from traces.
- ``python -m fasttrain evaluate WEIGHTS [flags]`` evaluates weights on a val set
  (``--test-only --weights WEIGHTS``: the training flags apply).
- ``python -m fasttrain export CHECKPOINT OUT`` writes a checkpoint's weights as a state dict.

Parse -> Config -> train. A ``UserError`` anywhere becomes one line on stderr and its exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fasttrain.config.cli import Parser
from fasttrain.run.watchdog import bound_exit


def say(msg: str) -> None:
    print(f"fasttrain: {msg}", file=sys.stderr)


def check_data(argv: Sequence[str]) -> int:
    from fasttrain.config.paths import default_exclude_list
    from fasttrain.data.check import find_bad_files, write_exclude_list

    p = Parser(
        prog="python -m fasttrain check-data",
        description="Decode every image under DIR/train and DIR/val, list the ones that fail, and "
        "write them to a list that training leaves out (found automatically for --data DIR).",
    )
    p.add_argument("dir", help="dataset root with train/ and val/ class folders")
    p.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="decoding processes (default: one per CPU core)",
    )
    p.add_argument(
        "--output",
        help="where to write the list (default: the cache, where training finds it for --data DIR)",
    )
    p.add_argument(
        "--no-dali",
        action="store_true",
        help="skip the second pass through DALI's decoder (run where DALI is installed)",
    )
    args = p.parse_args(argv)
    t = time.perf_counter()
    checked, bad = find_bad_files(
        args.dir, max(1, args.workers), progress=lambda i, n: say(f"checked {i:,} / {n:,}")
    )
    from fasttrain.data.dali_install import dali_available

    if dali_available() and not args.no_dali:
        from fasttrain.data.check import find_dali_rejects
        from fasttrain.data.folder import scan_folder

        rejected = {path for path, _ in bad}
        ds = scan_folder(args.dir)
        good = [path for path, _ in ds.train + ds.val if path not in rejected]
        say(f"decoding the {len(good):,} files PIL read with DALI's decoder too")
        bad += find_dali_rejects(
            good,
            max(1, args.workers),
            progress=lambda i, n: i % 4096 < 64 and say(f"DALI checked {i:,} / {n:,}"),
        )
    for path, reason in bad:
        print(f"{path}\t{reason}")
    out = Path(args.output) if args.output else default_exclude_list(args.dir)
    write_exclude_list(out, args.dir, bad)
    took = f"{time.perf_counter() - t:.0f} s"
    if bad:
        say(
            f"{len(bad)} of {checked:,} images failed to decode ({took}); wrote {out}, which "
            f"training on --data {args.dir} now leaves out"
        )
    else:
        say(f"all {checked:,} images decode ({took}); wrote {out}, an empty list")
    return 0


def profile_summary(argv: Sequence[str]) -> int:
    from fasttrain.errors import UserError
    from fasttrain.metrics.breakdown import find_traces, summarize, table

    p = Parser(
        prog="python -m fasttrain profile-summary",
        description="Recompute the step-time breakdown (compute, NCCL, memcpy, idle, host waits) "
        "from saved torch.profiler traces: a run's profile/ directory or one trace file.",
    )
    p.add_argument("trace_dir", help="a --profile run's <output-dir>/profile, or a .pt.trace.json")
    p.add_argument("--json", help="also write every trace's breakdown to this JSON file")
    args = p.parse_args(argv)
    traces = find_traces(args.trace_dir)
    if not traces:
        where = Path(args.trace_dir)
        if where.is_dir() and (where.name == "profile" or (where / "config.yaml").is_file()):
            raise UserError(
                f"{args.trace_dir}: no *.pt.trace.json files: the run ended before the "
                "profiler's schedule recorded anything; run it with more steps (--max-steps) "
                "or a shorter --profile-wait"
            )
        raise UserError(f"{args.trace_dir}: no *.pt.trace.json files (run with --profile first)")
    summaries = [summarize(t) for t in traces]
    for s in summaries:
        print(table(s))
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(summaries, indent=2) + "\n")
    return 0


def export(argv: Sequence[str]) -> int:
    from fasttrain.run.weights import export_state_dict, read_state_dict

    p = Parser(
        prog="python -m fasttrain export",
        description="Write a checkpoint's model weights as a plain state dict with torchvision's "
        "keys (no optimizer, no loader state), which torchvision.models.<arch>(num_classes=N) "
        "loads as it is. A checkpoint's BatchNorm statistics are already averaged over the "
        "ranks. The format follows OUT's suffix: .safetensors (needs the safetensors package) "
        "or a torch file (.pt, .pth).",
    )
    p.add_argument("checkpoint", help="a fasttrain checkpoint (ckpt-*.pt) or any state dict file")
    p.add_argument("out", help="where to write the weights (.pt, .pth or .safetensors)")
    p.add_argument(
        "--ema",
        action="store_true",
        help="write the checkpoint's moving average of the weights (a --model-ema run's)",
    )
    args = p.parse_args(argv)
    state = read_state_dict(args.checkpoint, flag="export", key="model_ema" if args.ema else None)
    out = export_state_dict(state, args.out)
    say(f"wrote {len(state)} tensors of {args.checkpoint} to {out}")
    return 0


def evaluate_argv(argv: list[str]) -> list[str]:
    """``evaluate WEIGHTS [flags]`` as the trainer's flags: ``--test-only --weights WEIGHTS``."""
    if argv[:1] and not argv[0].startswith("-"):
        return ["--test-only", "--weights", argv[0], *argv[1:]]
    return ["--test-only", *argv]


def launch(argv: list[str]) -> int | None:
    """``--nproc-per-node N``: start N copies of this command through torch.distributed.run
    (torchrun's own code: rendezvous, environment, elastic agent). None if not asked for."""
    for i, arg in enumerate(argv):
        if arg == "--nproc-per-node" or arg.startswith("--nproc-per-node="):
            value = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[:i] + argv[i + (1 if "=" in arg else 2) :]
            break
    else:
        return None
    from fasttrain.errors import UserError

    if not value.isdigit() or int(value) < 1:
        raise UserError(f"--nproc-per-node {value!r}: expected a positive number of processes")
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


SUBCOMMANDS = ("env", "check-data", "profile-summary", "export")  # the rest trains (or evaluates)


def main(argv: Sequence[str] | None = None) -> int:
    t_start = time.perf_counter()
    run_log: Path | None = None  # known once the config is resolved
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["evaluate"]:
        argv = evaluate_argv(argv[1:])
    if not (argv[:1] and argv[0] in SUBCOMMANDS) and ("-h" in argv or "--help" in argv):
        from fasttrain.config.cli import build_parser

        build_parser().print_help()  # before torch is imported: --help answers at once
        return 0
    from fasttrain.dist.state import claim_hardware_queues

    claim_hardware_queues()  # before CUDA starts; torchrun's workers inherit it
    import torch

    from fasttrain.errors import UserError

    if argv[:1] == ["env"]:
        from fasttrain.envreport import env_report

        print(env_report())
        return 0
    try:
        if argv[:1] == ["check-data"]:
            return check_data(argv[1:])
        if argv[:1] == ["profile-summary"]:
            return profile_summary(argv[1:])
        if argv[:1] == ["export"]:
            return export(argv[1:])
        launched = launch(argv)
        if launched is not None:
            return launched
        from fasttrain.config.cli import parse_args
        from fasttrain.config.paths import cache_dir
        from fasttrain.dist.state import DistState
        from fasttrain.run.resolve import resolve

        cfg, notes = parse_args(argv, cuda_available=torch.cuda.is_available())
        dist = DistState.from_env(cfg.train.device, cfg.train.dist_timeout)
        try:
            resolve(cfg, dist, notes=notes)
            run_log = Path(cfg.run.output_dir) / f"log-rank{dist.rank}.txt"
            if dist.is_main:
                for note in notes:
                    say(note)
            if cfg.data.path is None and cfg.data.loader != "synthetic":
                from fasttrain.data.sample import build_sample

                t_build = time.perf_counter()
                if dist.is_main:  # one builder; the other ranks then find it built
                    build_sample(cache_dir(), log=say, bar=True)
                dist.barrier()
                cfg.data.path = str(build_sample(cache_dir(), log=lambda m: None))
                if time.perf_counter() - t_build > 1 and dist.is_main:
                    say(f"sample dataset ready after {time.perf_counter() - t_build:.0f} s")
                t_start = time.perf_counter()  # a one-off build is not part of start-up cost
            if cfg.run.test_only:
                from fasttrain.run.evaluate_only import evaluate_only

                evaluate_only(cfg, dist)
            else:
                from fasttrain.run.train import train

                train(cfg, dist, t_start)
        finally:
            dist.close()
    except UserError as e:
        print(f"fasttrain: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fasttrain: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug or an unforeseen fault: keep its traceback, say where the log is
        logging.getLogger("fasttrain").exception("the run failed")
        where = f"; the run's log is {run_log}" if run_log is not None else ""
        say(f"error: an unexpected failure, traceback above{where}")
        return 1
    return 0


def entry() -> None:
    """The program: ``main``, then an exit bounded in time (``watchdog.bound_exit``)."""
    code = main()
    bound_exit()
    sys.exit(code)


if __name__ == "__main__":
    entry()
