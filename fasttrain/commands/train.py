"""Training, and ``evaluate`` (``--test-only``): parse the flags, start the processes' group,
resolve the settings and the run folder, build the sample set where no ``--data`` is given, then
train or evaluate."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from fasttrain.commands import say, unexpected_failure
from fasttrain.config import Config
from fasttrain.config.cli import parse_args
from fasttrain.config.paths import cache_dir
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.metrics.startup import Startup
from fasttrain.run.compile_cache import FOLDER, compile_root
from fasttrain.run.jit_kept import places, restore
from fasttrain.run.resolve import resolve
from fasttrain.run.runs import place_run
from fasttrain.step.conv_warmup import jit_cache_empty


def main(argv: Sequence[str], t_start: float) -> int:
    """Train (or evaluate) as ``argv`` says; ``t_start``: when the program started, for the
    start-up time it reports."""
    # before anything of CUDA's, which can put kernels into an empty JIT cache (conv_warmup)
    empty = jit_cache_empty(os.environ)
    cfg, notes = parse_args(argv, cuda_available=torch.cuda.is_available())
    # a machine whose JIT cache is empty takes the one the run or the compile cache kept
    restored = restore_jit_cache(cfg) if empty else None
    if restored is not None:
        notes.append(f"CUDA's JIT cache: this machine's was empty, so it starts with {restored}")
    startup = Startup(t_start, jit_cache_empty=empty and restored is None)
    dist = DistState.from_env(cfg.train.device, cfg.train.dist_timeout)
    startup.mark("imports, flags and the process group")
    run_log: Path | None = None  # known once the config is resolved
    try:
        try:
            resolve(cfg, dist, notes=notes)
            startup.mark("settings and cuDNN's probe")
            place_run(cfg, notes)
            run_log = Path(cfg.run.output_dir) / f"log-rank{dist.rank}.txt"
            if dist.is_main:
                for note in notes:
                    say(note)
            if cfg.data.path is None and cfg.data.loader != "synthetic":
                startup.mark("settings and cuDNN's probe")  # the run folder and the notes
                startup.leave_out(use_sample_set(cfg, dist))  # a one-off build
            if cfg.run.test_only:
                from fasttrain.run.evaluate_only import evaluate_only

                evaluate_only(cfg, dist)
            else:
                from fasttrain.run.train import train

                train(cfg, dist, startup)
        finally:
            dist.close()
    except (UserError, KeyboardInterrupt):
        raise
    except Exception:
        return unexpected_failure(run_log)
    return 0


def restore_jit_cache(cfg: Config) -> Path | None:
    """Put back CUDA's JIT cache kept by the run's folder (``--output-dir``, or the folder of
    ``--resume``'s checkpoint) or the compile caches' directory (``run/jit_kept.py``), for a
    machine whose own was empty at the process's start; the kept file it used, or None."""
    run_dir = cfg.run.output_dir
    if cfg.run.resume not in (None, "auto"):
        run_dir = str(Path(cfg.run.resume).parent)
    run_kept = Path(run_dir) / FOLDER if run_dir is not None else None
    return restore(places(run_kept, compile_root(cfg)), os.environ)


def use_sample_set(cfg: Config, dist: DistState) -> float:
    """Build the built-in sample set (once, on the main process) and train on it; returns the
    seconds it took, which start-up leaves out: a one-off build is not part of it."""
    from fasttrain.data.sample import build_sample

    t_build = time.perf_counter()
    if dist.is_main:  # one builder; the other ranks then find it built
        build_sample(cache_dir(), log=say, bar=True)
    dist.barrier()
    cfg.data.path = str(build_sample(cache_dir(), log=lambda m: None))
    seconds = time.perf_counter() - t_build
    if seconds > 1 and dist.is_main:
        say(f"sample dataset ready after {seconds:.0f} s")
    return seconds
