"""``python -m fasttrain compile``: compile, in one process, what every process of a job with
the same flags compiles, into the compile cache the job reads, then stop.

A job's ranks each compile the step at their first start, all at once: the cache has nothing
yet for any of them to find. Compiled here first, the job's every rank (on every node, where
the cache is on a shared filesystem) finds each graph in the cache, and so do later jobs and
a sweep over what the compiled step does not see (the LR, the epochs).

- **One process stands for the job.** The flags are resolved as each rank of the job resolves
  them (``resolve`` with the job's world size and nodes: the strategy, DDP's bucket size), so
  the cache key is the job's (``compile_cache.key``). Dynamo splits a DDP model's graph at its
  gradient buckets, which depend on the bucket size and the parameters, not on how many ranks
  there are; so a DDP over a process group of this one process compiles the graphs each rank
  of the job compiles.
- **What a run compiles,** one step of each train size the run trains at (the first epoch at
  each), and evaluation's forward on one val batch, with the model and its average. The steps
  train a throwaway model: no run folder, no checkpoint.
- Not for ``--sync-bn`` jobs: its statistics' all-reduce is inside the compiled forward, and
  a group of one process compiles the forward without it.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from fasttrain.config import Config
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.metrics.meter import DeviceMeter
from fasttrain.metrics.startup import (
    Heartbeat,
    Startup,
    compile_parts,
    compile_totals,
    fx_cache_counts,
)
from fasttrain.run.build import build
from fasttrain.run.compile_cache import Artifacts, configure_compile_caches, key
from fasttrain.run.runtime import configure_backends, seed_everything
from fasttrain.step.parallel_tuning import candidates_sent

log = logging.getLogger("fasttrain")


def job_shape(nproc_per_node: int, nnodes: int, device: torch.device) -> DistState:
    """The job's rank 0 as the flags' resolution sees it: its world size and nodes (no process
    group is started for it)."""
    return DistState(0, 0, nproc_per_node * nnodes, device, nproc_per_node)


def check(cfg: Config, job: DistState) -> None:
    """Refuse, in one line, flags for which one process cannot compile the job's step."""
    if not cfg.train.compile:
        raise UserError(
            "compile: these flags train without --compile, so a run with them compiles "
            "nothing; give the job's flags, --compile among them"
        )
    if job.distributed and cfg.train.sync_bn:
        raise UserError(
            "compile: --sync-bn all-reduces BN statistics inside the compiled forward, which "
            "one process cannot compile for several; the job's own first start compiles it"
        )


def precompile(cfg: Config, job: DistState, startup: Startup) -> dict[str, Any]:
    """Compile what each process of ``job`` compiles for the resolved ``cfg``, into the compile
    cache it reads (module notes). Returns what was done: the key, the directory (None: inductor's
    own default), the shapes compiled, the seconds and the FX graph cache's hits and misses."""
    t = cfg.train
    check(cfg, job)
    if t.tune_kernels == "later":  # a run with it finds them tuned and puts nothing off
        log.info(
            "compile: this command tunes every kernel now (--tune-kernels later, which the "
            "job would run, tunes after its first step), so that the job finds them tuned"
        )
    solo = DistState(0, 0, 1, job.device, 1)  # this process: it runs the steps
    where = configure_compile_caches(cfg, job.world_size)
    cache_key = key(cfg, job.world_size)  # as the job keys it: before --batch-size auto's trials
    configure_backends(solo.device, t.strategy, t.deterministic)
    seed_everything(t.seed)
    group = _solo_process_group(solo) if job.distributed else False
    try:
        if t.batch_size is None:  # measured here as the job's ranks measure it
            from fasttrain.run.autobatch import fill_auto_batch_size

            fill_auto_batch_size(cfg, solo, None)
        built = build(cfg, solo, None, startup)
        startup.mark("data, model and optimizer")
        before = compile_totals()
        t0 = time.perf_counter()
        shapes = []
        with Heartbeat("compile", startup.t_start):
            for epoch in _first_epoch_of_each_size(cfg):
                shapes.append(_one_step(cfg, built, epoch, solo))
            for evaluator in (built.evaluator, built.ema_evaluator):
                if evaluator is not None and built.data.val is not None:
                    evaluator(itertools.islice(built.data.val, 1))
            if solo.device.type == "cuda":
                torch.cuda.synchronize(solo.device)
        seconds = time.perf_counter() - t0
        after = compile_totals()
        Artifacts(None, cfg, job.world_size, is_main=True).save()  # dynamo's trace, if kept
        built.data.close()
    finally:
        if group:
            tdist.destroy_process_group()

    return {
        "key": cache_key,
        "cache": str(where) if where is not None else None,
        "shapes": shapes,
        "evaluation": built.evaluator is not None and built.data.val is not None,
        "compile_s": seconds,
        "parts_s": {k: round(v, 3) for k, v in compile_parts(before, after).items() if v > 0},
        "fx_graph_cache": fx_cache_counts(before, after),
        "tuning_candidates_ahead": candidates_sent(),
    }


def _solo_process_group(solo: DistState) -> bool:
    """A process group of this process alone, for DDP to wrap the model in as each rank of the
    job does (module notes); False where one exists already."""
    if tdist.is_initialized():
        return False
    tdist.init_process_group(
        "nccl" if solo.device.type == "cuda" else "gloo",
        store=tdist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=600),
        device_id=solo.device if solo.device.type == "cuda" else None,
    )
    return True


def _first_epoch_of_each_size(cfg: Config) -> list[int]:
    """The first epoch at each train size the run trains at, in the run's order."""
    resolution, seen, epochs = cfg.typed.resolution, set(), []
    for epoch in range(cfg.train.epochs):
        size = resolution.size_at(epoch)
        if size not in seen:
            seen.add(size)
            epochs.append(epoch)
    return epochs


def _one_step(cfg: Config, built: Any, epoch: int, solo: DistState) -> dict[str, int]:
    """One training step on the first batches of ``epoch``; the shape it compiled."""
    loader = built.data.train
    loader.set_epoch(epoch, 0)
    it = iter(loader)
    batches = [next(it) for _ in range(cfg.train.accum_steps)]
    built.training.step(batches, DeviceMeter(solo.device, solo), 0)
    images = batches[0][0]
    return {"epoch": epoch, "batch": int(images.shape[0]), "size": int(images.shape[-1])}
