"""Process-wide setup for a run: per-rank log files, seeds and backend flags."""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from fasttrain.dist.state import DistState

log = logging.getLogger("fasttrain")


class _TqdmHandler(logging.StreamHandler):
    """Console output that does not tear a live progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging(out: Path | None, dist: DistState) -> None:
    """Every rank logs to ``log-rank{N}.txt`` in ``out`` (None: no file, for a command that
    keeps no folder); only the main process also prints."""
    log.setLevel(logging.DEBUG)
    log.propagate = False
    detach_logging()  # a second run in the same process (tests) starts clean
    if out is not None:
        fh = logging.FileHandler(out / f"log-rank{dist.rank}.txt")
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(fh)
    if dist.is_main:
        ch = _TqdmHandler()
        ch.setLevel(logging.INFO)
        ch.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(ch)
    # Python warnings (torch's among them) go the same way: into this rank's log, and printed
    # above the progress bar instead of onto its line
    logging.captureWarnings(False)  # re-arm: a run before this one in the process may have left it
    logging.captureWarnings(True)
    warn_log = logging.getLogger("py.warnings")
    warn_log.propagate = False
    for h in log.handlers:
        warn_log.addHandler(h)


def detach_logging() -> None:
    """Close and remove the run's log handlers, from fasttrain's logger and the warnings'."""
    for logger in (log, logging.getLogger("py.warnings")):
        for h in list(logger.handlers):
            h.close()
            logger.removeHandler(h)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def configure_backends(
    device: torch.device, strategy: str = "none", deterministic: bool = False
) -> None:
    """Fast defaults on the GPU: cuDNN autotuning (fixed shapes) and TF32 for any fp32 matmul.

    Not autotuning under DataParallel: it runs every forward in new threads, and cuDNN's
    benchmarked plans are cached per thread (pytorch PR 103939), so each step would benchmark
    every convolution again. On two H200s DP ran at 334 img/s with autotuning, its GPUs idle 89%
    of each step (BENCHMARKS.md).

    ``deterministic`` (``--deterministic``) trades that speed for runs that repeat bit for bit:
    no autotuning, cuDNN's and torch's deterministic algorithms, inductor's deterministic mode.
    """
    if deterministic:
        # cuBLAS needs a fixed workspace to reduce in a fixed order; read when CUDA starts
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        from torch._inductor import config as inductor_config

        if "deterministic" in inductor_config.get_config_copy():
            inductor_config.deterministic = True
        log.info(
            "--deterministic: deterministic algorithms, no cuDNN autotuning (an op without a "
            "deterministic kernel warns in this log)"
        )
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = strategy != "dp" and not deterministic
        torch.set_float32_matmul_precision("high")
        if strategy == "dp":
            log.info(
                "--strategy dp: cuDNN autotuning is off (DataParallel's per-step threads would "
                "benchmark every convolution again each step)"
            )
