"""The ``run`` section: the run's folder and name, resume, evaluation-only, and the cadences of
logging, evaluation, checkpoints and profiling."""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config.option import option


@dataclass
class RunConfig:
    output_dir: str | None = option(
        None,
        "--output-dir",
        "run directory for checkpoints, logs and TensorBoard (default: runs/<name or time>)",
        nullable=True,
    )
    name: str | None = option(
        None, "--name", "run name, used for the default --output-dir", nullable=True
    )
    test_only: bool = option(
        False,
        "--test-only",
        "evaluate the --weights on the val set and exit, training nothing (as torchvision's "
        "train.py; also python -m fasttrain evaluate WEIGHTS): top-1/top-5 are printed and "
        "written to <output-dir>/eval.json",
    )
    break_lock: bool = option(
        False,
        "--break-lock",
        "take the run folder's lock even from a run on another host, which this host cannot "
        "check (a run owns its folder: a second run there stops, and a lock left by a process "
        "on this host that is gone is taken over by itself); only when that run is gone",
    )
    resume: str | None = option(
        None,
        "--resume",
        "checkpoint to resume from, or 'auto' for the newest valid checkpoint in --output-dir",
        nullable=True,
    )
    log_every: int = option(
        50,
        "--log-every",
        "optimizer steps between log steps. A log step reads the interval before it, whose "
        "work is done, so it never waits for the GPU: each log line comes one interval late",
        minimum=1,
        aliases=("--print-freq",),
    )
    eval_every: int = option(1, "--eval-every", "epochs between evaluations (0: never)", minimum=0)
    ckpt_every_steps: int = option(
        0,
        "--ckpt-every-steps",
        "also checkpoint every this many optimizer steps (0: only at the end of each epoch)",
        minimum=0,
    )
    keep_checkpoints: int = option(
        3, "--keep-checkpoints", "how many recent checkpoints to keep", minimum=1
    )
    profile: bool = option(
        False,
        "--profile",
        "profile with torch.profiler (CPU and CUDA): traces per rank under <output-dir>/profile "
        "for Perfetto or chrome://tracing, and each step's breakdown (compute, communication, "
        "copies, idle; the host's loader wait, copy to the device and sync) and top kernels, "
        "logged and in TensorBoard's Text and Images dashboards",
    )
    profile_wait: int = option(
        20,
        "--profile-wait",
        "--profile: steps to skip before each cycle (past compile and CUDA-graph capture)",
        minimum=0,
    )
    profile_warmup: int = option(2, "--profile-warmup", "--profile: warm-up steps", minimum=0)
    profile_active: int = option(5, "--profile-active", "--profile: steps recorded", minimum=1)
    profile_repeat: int = option(
        1,
        "--profile-repeat",
        "--profile: cycles of wait, warm-up and active steps (0: until the run ends)",
        minimum=0,
    )
