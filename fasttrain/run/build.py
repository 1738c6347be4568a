"""Build what a run trains with, in one place.

``build_training`` makes the model, its parallel wrapper, the schedule, the optimizer, the loss
and the step; ``build`` adds the data and the evaluator. The trainer, ``--batch-size auto``'s
trials, the benchmarks and the tests all take their parts from here, so they train the same
thing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fasttrain.config import Config
from fasttrain.data.build import build_data
from fasttrain.data.loader import Data, Loader
from fasttrain.dist.parallel import wrap_model
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.metrics.startup import Startup
from fasttrain.model.build import build_configured_model
from fasttrain.step.conv_warmup import ConvWarmup, start_conv_warmup
from fasttrain.step.ema import ModelEma
from fasttrain.step.erase import Eraser
from fasttrain.step.evaluate import Evaluator
from fasttrain.step.mix import Mixer
from fasttrain.step.optim import build_optimizer, plan_schedule
from fasttrain.step.plan import Plan
from fasttrain.step.step import build_loss, build_step, compile_kwargs
from fasttrain.step.training import Training

log = logging.getLogger("fasttrain")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


@dataclass
class Built:
    """A whole run's parts: the data, the training parts and the evaluator."""

    data: Data
    training: Training
    evaluator: Evaluator | None  # None when there is nothing to evaluate, or --eval-every 0
    loader_batch: int  # the loader's batch: --batch-size, times the GPUs under DataParallel
    gpus: int
    plan: Plan  # every epoch's steps and global batch
    ema_evaluator: Evaluator | None = None  # --model-ema: the same evaluation of the average
    # cuDNN's convolutions running ahead of the first step (``step/conv_warmup.py``)
    conv_warmup: ConvWarmup | None = None

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over every GPU and micro-batch, in the first epoch."""
        return self.plan.global_batches[0]

    @property
    def steps_per_epoch(self) -> int:
        """The first epoch's optimizer steps."""
        return self.plan.steps[0]


def augment_seed(seed: int, rank: int, stream: int) -> int:
    """A batch augmentation's generator seed: its own stream of --seed, its own per rank (each
    rank augments its own shard its own way)."""
    return seed * 1_000_003 + rank * 101 + stream


def amp_dtype(cfg: Config) -> torch.dtype | None:
    return AMP_DTYPES[cfg.train.amp]


def compile_options(cfg: Config) -> dict:
    """torch.compile's keyword arguments for the resolved --compile-mode and --inductor-options."""
    t = cfg.train
    return compile_kwargs(t.compile_mode, dict(cfg.typed.inductor))


def build_evaluator(cfg: Config, dist: DistState, model: nn.Module, batch_size: int) -> Evaluator:
    """The evaluation of ``model`` the flags describe (precision, --compile, --cuda-graphs): one
    place for the run's model, its average and ``evaluate``."""
    t = cfg.train
    return Evaluator(
        model,
        amp_dtype(cfg),
        t.compile,
        batch_size,
        compile_options=compile_options(cfg) if t.compile else None,
        cuda_graphs=t.cuda_graphs,
        dist=dist,
    )


def build_training(
    cfg: Config,
    dist: DistState,
    *,
    num_classes: int,
    plan: Plan,
    fixed_inputs: bool = False,
    parallel: bool = True,
    compile: bool | None = None,
    on_model: Callable[[nn.Module], None] | None = None,
) -> Training:
    """The model, wrapper, schedule, optimizer, loss and step that ``cfg`` describes; the LR
    schedule follows ``plan`` (each epoch's steps and global batch).

    ``fixed_inputs``: the loader refills the same tensors every step (``Loader.fixed_buffers``).
    ``parallel=False`` leaves the model unwrapped (``--batch-size auto``'s trials, which must not
    run collectives); ``compile`` overrides ``--compile``. ``on_model`` is called with the model
    as soon as it is built, before the rest."""
    t = cfg.train
    kernels = cfg.typed.kernels
    model = build_configured_model(cfg.model, num_classes, dist.device, kernels)
    if on_model is not None:
        on_model(model)
    wrapped = wrap_model(model, t, dist) if parallel else None
    net = wrapped.net if wrapped else model
    schedule = plan_schedule(cfg.optim, plan)
    triton_sgd = "sgd" in kernels
    optimizer = build_optimizer(model, cfg.optim, schedule.lr_at(0), triton=triton_sgd)
    criterion, scaler = build_loss(cfg.optim.label_smoothing, t.amp, xent="xent" in kernels)
    compiled = t.compile if compile is None else compile
    ema = (
        ModelEma(model, t.model_ema_decay, t.model_ema_steps, t.model_ema_warmup)
        if t.model_ema
        else None
    )
    mixer = (
        Mixer(
            num_classes,
            t.mixup_alpha,
            t.cutmix_alpha,
            t.mixup_prob,
            t.mixup_switch_prob,
            device=dist.device,
            seed=augment_seed(t.seed, dist.rank, 1),
        )
        if t.mixup_alpha > 0 or t.cutmix_alpha > 0
        else None
    )
    eraser = (
        Eraser(t.random_erase, device=dist.device, seed=augment_seed(t.seed, dist.rank, 2))
        if t.random_erase > 0
        else None
    )
    step = build_step(
        model=net,
        optimizer=optimizer,
        criterion=criterion,
        amp_dtype=amp_dtype(cfg),
        scaler=scaler,
        schedule=schedule,
        compile=compiled,
        compile_options=compile_options(cfg) if compiled else None,
        cuda_graphs=t.cuda_graphs,
        fixed_inputs=fixed_inputs,
        side_stream=wrapped.side_stream if wrapped else None,
        clip_grad_norm=cfg.optim.clip_grad_norm,
        ema=ema,
        mixer=mixer,
        eraser=eraser,
    )
    return Training(model, net, schedule, optimizer, criterion, scaler, step, ema, mixer, eraser)


def build(
    cfg: Config,
    dist: DistState,
    loader_state: dict | None = None,
    startup: Startup | None = None,
    *,
    warm_up_convs: bool = False,
    start_epoch: int = 0,
) -> Built:
    """Data, training parts and evaluator for a resolved ``cfg`` (with a batch size: ``--batch-size
    auto`` is measured before this). ``loader_state`` resumes the train loader; ``startup``
    marks the data's and the model's time. ``warm_up_convs``: start cuDNN's convolutions ahead
    of the first step (``step/conv_warmup.py``) as soon as the model is built, at the shapes of
    ``start_epoch``, the run's first."""
    t, parsed = cfg.train, cfg.typed
    # --batch-size is per GPU: DataParallel's one process feeds every GPU from one loader batch
    replicas = torch.cuda.device_count() if t.strategy == "dp" else 1
    loader_batch = t.batch_size * replicas
    loader_batches = {size: b * replicas for size, b in parsed.batch_sizes.items()}
    data = build_data(
        cfg.data,
        resolution=parsed.resolution,
        batch_size=loader_batch,
        num_classes=cfg.model.num_classes,
        seed=t.seed,
        dist=dist,
        dtype=amp_dtype(cfg) or torch.float32,
        channels_last=cfg.model.channels_last,
        accum_steps=t.accum_steps,
        triton_normalize="normalize" in parsed.kernels,
        loader_state=loader_state,
        batches=loader_batches,
    )
    if startup is not None:
        startup.mark("data: scan and loader")
    plan = epoch_plan(cfg, data.train, loader_batch, loader_batches, dist.world_size)
    warmups: list[ConvWarmup] = []

    def warm_up(model: nn.Module) -> None:
        resolution = parsed.resolution
        size = resolution.size_at(start_epoch)
        batch = resolution.batch_at(start_epoch, loader_batches, loader_batch)
        shape = (batch, 3, size, size)
        fresh = startup.jit_cache_empty if startup is not None else None
        started = start_conv_warmup(
            model, amp_dtype(cfg), shape, cfg.model.channels_last, os.environ, fresh
        )
        if started is not None:
            warmups.append(started)

    training = build_training(
        cfg,
        dist,
        num_classes=data.num_classes,
        plan=plan,
        fixed_inputs=data.train.fixed_buffers,
        on_model=warm_up if warm_up_convs else None,
    )
    evaluator = ema_evaluator = None
    if data.val is not None and cfg.run.eval_every > 0:
        evaluator = build_evaluator(cfg, dist, training.model, loader_batch)
        if training.ema is not None:
            ema_evaluator = build_evaluator(cfg, dist, training.ema.module, loader_batch)
    gpus = dist.world_size * replicas
    if startup is not None:
        startup.mark("model and optimizer")
    warmup = warmups[0] if warmups else None
    return Built(data, training, evaluator, loader_batch, gpus, plan, ema_evaluator, warmup)


def epoch_plan(
    cfg: Config, train: Loader, batch: int, batches: Mapping[int, int], world: int
) -> Plan:
    """Each epoch's optimizer steps and global batch: the loader's batch at the epoch's train
    size (``batches``, else ``batch``), over every process and micro-batch."""
    accum, resolution = cfg.train.accum_steps, cfg.typed.resolution
    steps, global_batches = [], []
    for epoch in range(cfg.train.epochs):
        b = resolution.batch_at(epoch, batches, batch)
        steps.append(train.batches_in(epoch) // accum)
        global_batches.append(b * world * accum)
        if steps[-1] == 0:
            raise UserError(
                f"--accum-steps {accum}: epoch {epoch} has only {train.batches_in(epoch)} "
                "batches, fewer than one optimizer step; lower it or --batch-size"
            )
    return Plan(tuple(steps), tuple(global_batches))
