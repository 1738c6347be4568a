"""Everything between the run directory and the first step: backends and seeds, the batch
size, the parts (``builder.build``), the starting weights or the resume, the folder's lineage,
and the start-up lines that say what will run."""

from __future__ import annotations

import logging
import math
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from fasttrain.config import Config
from fasttrain.config.cli import save_resolved
from fasttrain.dist.parallel import ddp_description
from fasttrain.dist.state import DistState
from fasttrain.metrics.profiling import configure
from fasttrain.metrics.startup import Heartbeat, Startup
from fasttrain.run import checkpoint as ckpt
from fasttrain.run import resume
from fasttrain.run.build import Built, build
from fasttrain.run.compile_cache import Artifacts, configure_compile_caches
from fasttrain.run.runtime import configure_backends, seed_everything
from fasttrain.run.weights import load_weights, read_state_dict
from fasttrain.step.training import Training

log = logging.getLogger("fasttrain")


def set_up(
    cfg: Config,
    dist: DistState,
    run_dir: Path,
    resumed: tuple[str, dict[str, Any]] | None,
    startup: Startup,
) -> tuple[Built, int, Artifacts]:
    """Everything between the run directory and the first step: backends and seeds, the batch
    size, the parts (``builder.build``), the resume, the folder's lineage, each phase marked in
    ``startup``. Returns the parts, the step to start from and the run folder's compile
    artifacts (loaded)."""
    t = cfg.train
    if cfg.run.resume == "auto" and resumed is None:
        log.info("--resume auto: no checkpoint in %s yet; starting from scratch", run_dir)
    configure(record=cfg.run.profile, nvtx=dist.device.type == "cuda")
    where = configure_compile_caches(cfg, dist.world_size) if t.compile else None
    if where is not None and dist.is_main:
        log.info("compile caches in %s (--compile-cache)", where)
    log.debug("rank %d of %d: process %d", dist.rank, dist.world_size, os.getpid())
    configure_backends(dist.device, t.strategy, t.deterministic)
    if dist.device.type == "cuda":
        torch.empty(0, device=dist.device)  # CUDA's context, now, so that its start is timed
    startup.mark("run directory, backends and CUDA start")
    seed_everything(t.seed)
    if t.batch_size is None:
        from fasttrain.run.autobatch import fill_auto_batch_size

        fill_auto_batch_size(cfg, dist, resumed)
        if dist.is_main:
            save_resolved(cfg, run_dir / "config.yaml")  # the number, so the file reproduces it
    loader_state = (
        resume.loader_state_for(resumed[1], dist.rank, dist.world_size) if resumed else None
    )
    artifacts = Artifacts(run_dir, cfg, dist.world_size, dist.is_main)
    # cuDNN's convolutions run on a thread from the model's build on, beside the rest of the
    # set-up and the step's compile, at the shapes of the epoch the run starts in
    epoch = int(resumed[1].get("epoch", 0)) if resumed else 0
    with setup_heartbeat(dist, startup):
        artifacts.load()  # before torch.compile: it looks for dynamo's saved trace when it wraps
        built = build(cfg, dist, loader_state, startup, warm_up_convs=t.compile, start_epoch=epoch)
    if dist.is_main:  # a full disk is a one-line error now, not at the first save
        need = ckpt.checkpoint_bytes(built.training.model)
        ckpt.check_free_space(run_dir, need, cfg.run.keep_checkpoints)
    tunes = cfg.typed.inductor.get("coordinate_descent_tuning")
    if t.compile and dist.is_main and ("autotune" in t.compile_mode or tunes):
        when = (
            "trains on inductor's untuned kernels, then benchmarks their choices in one step "
            "(about a minute for ResNet-50; --tune-kernels later)"
            if t.tune_kernels == "later" and tunes
            else "benchmarks inductor's kernel choices before its first step (minutes for "
            "ResNet-50)"
        )
        log.info(
            "--compile-mode %s, --inductor-options %s: the first start %s; later starts reuse "
            "inductor's cache. --compile-mode default --inductor-options none compiles in about "
            "a minute and tunes nothing, a few percent slower per step",
            t.compile_mode,
            t.inductor_options,
            when,
        )
    step = 0
    if cfg.model.weights is not None and not resumed:
        source = f"--weights {cfg.model.weights}"
        load_weights(built.training.model, read_state_dict(cfg.model.weights), source)
        log.info("%s: the model starts from these weights", source)
    elif cfg.model.weights is not None:
        log.info(
            "--weights %s: not loaded, the run resumes from %s, which holds its weights",
            cfg.model.weights,
            resumed[0],
        )
    if resumed:
        step = resume.resume(*resumed, cfg, built.training, built.plan)
        resume.restore_augments(resumed[1], built.training, dist.rank, dist.world_size)
    if dist.is_main:
        ckpt.set_aside(run_dir, step)
    dist.barrier("the barrier after preparing the run directory")
    log_setup(cfg, dist, built, step)
    startup.mark("weights, resume and the run directory")
    return built, step, artifacts


def total_steps(cfg: Config, training: Training) -> int:
    """Where the run ends: the schedule's last step (``--epochs``), or ``--max-steps`` first."""
    return int(min(cfg.train.max_steps or math.inf, training.schedule.total_steps))


def log_setup(cfg: Config, dist: DistState, built: Built, step: int) -> None:
    t, training = cfg.train, built.training
    total = total_steps(cfg, training)
    unit = "GPU" if t.device == "cuda" else "process"  # the CPU has processes, not GPUs
    log.info(
        "%s, %d classes, %.1fM params | %s",
        cfg.model.arch,
        built.data.num_classes,
        sum(p.numel() for p in training.model.parameters()) / 1e6,
        built.data.description,
    )
    log.info(
        "device %s, amp %s, BatchNorm %s, step %s%s, strategy %s | global batch %d (%d per %s x "
        "%d %s x %d accum) | peak LR %.4g (%s) | %d steps per epoch, %d steps from step %d",
        dist.device,
        t.amp,
        cfg.typed.bn_path,
        training.step.description,
        f" (Triton kernels: {t.triton_kernels})" if t.triton_kernels != "none" else "",
        ddp_description(t, dist) if t.strategy == "ddp" else t.strategy,
        built.global_batch,
        t.batch_size,
        unit,
        built.gpus,
        unit + ("es" if unit == "process" else "s") if built.gpus > 1 else unit,
        t.accum_steps,
        training.schedule.peak_lr,
        f"--lr {cfg.optim.lr:g} x global batch {built.global_batch} / 256"
        if cfg.optim.lr_scaling == "linear"
        else "--lr, --lr-scaling none",
        built.steps_per_epoch,
        total,
        step,
    )
    if not built.plan.is_uniform:
        log.info("--batch-sizes %s: %s", t.batch_sizes, built.plan.describe())


def setup_heartbeat(dist: DistState, startup: Startup) -> AbstractContextManager:
    """The set-up's heartbeat on the main process: the compile artifacts, the data and the model,
    where loading dynamo's kept trace can take seconds (a kernel whose binary this machine
    lacks is compiled there)."""
    if not dist.is_main:
        return nullcontext()
    return Heartbeat(
        "setting up",
        startup.t_start,
        otherwise="building the data and the model",
        within="the set-up",
    )
