"""Timing and step builders shared by the GPU benchmark suites in bench/."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fasttrain.config import Config, OptimConfig
from fasttrain.config.parse import Parsed
from fasttrain.data.synthetic import SyntheticLoader
from fasttrain.dist.state import DistState
from fasttrain.metrics.meter import DeviceMeter
from fasttrain.run.build import AMP_DTYPES, build_training
from fasttrain.run.runtime import configure_backends
from fasttrain.step.plan import Plan


def loader_args(batch: int, image_size: int, device: torch.device) -> dict[str, Any]:
    """The keyword arguments every train loader takes, for one GPU (rank 0 of 1), seed 0."""
    return dict(
        train=True,
        image_size=image_size,
        batch_size=batch,
        seed=0,
        rank=0,
        world=1,
        device=device,
        channels_last=True,
    )


def make_step(
    kind: str,
    batch: int,
    *,
    arch: str = "resnet50",
    image_size: int = 224,
    kernels: str = "none",
    amp: str = "bf16",
    fused_bn: bool = False,
    cudnn_bn: bool = False,
    overrides: dict[str, Any] | None = None,
) -> tuple[Callable[[], None], Any, DeviceMeter]:
    """One step variant ('eager', 'compiled', 'eager+graph', 'compiled+graph') as the trainer
    builds it (``builder.build_training``: the sample recipe's optimizer and loss, channels_last,
    compile mode default; the trainer's backends: cuDNN autotuning, TF32) on synthetic data, in
    ``amp`` (bf16 or fp16), with the ``--triton-kernels`` named and optionally ``--fused-bn`` or
    ``--cudnn-bn``: a no-argument call that trains one step, the step, and its meter.
    ``overrides``: other settings by config key, e.g. ``{"train.model_ema": True}``."""
    dev = torch.device("cuda")
    configure_backends(dev)  # as the trainer's set-up does: cuDNN picks each convolution by timing
    torch.manual_seed(0)
    cfg = Config()
    cfg.model.arch, cfg.data.image_size = arch, image_size
    cfg.model.fused_bn = "on" if fused_bn else "off"
    cfg.model.cudnn_bn = cudnn_bn
    cfg.optim = OptimConfig(warmup_epochs=1, lr_schedule="cosine", label_smoothing=0.1)
    t = cfg.train
    t.amp, t.device, t.strategy, t.triton_kernels = amp, "cuda", "none", kernels
    t.compile, t.compile_mode, t.cuda_graphs = "compiled" in kind, "default", "graph" in kind
    for key, value in (overrides or {}).items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    cfg.parsed = Parsed.of(cfg)  # what resolve() would parse
    data = SyntheticLoader(
        batch_size=batch,
        image_size=image_size,
        num_classes=1000,
        steps=1,
        device=dev,
        dtype=AMP_DTYPES[amp],
        channels_last=True,
        seed=0,
    )
    dist = DistState(0, 0, 1, dev)
    training = build_training(
        cfg,
        dist,
        num_classes=1000,
        plan=Plan.uniform(5000, batch, cfg.train.epochs),
        fixed_inputs=data.fixed_buffers,
    )
    batch_pair = (data.images, data.labels)
    meter = DeviceMeter(dev)
    counter = iter(range(10**9))

    def one() -> None:
        training.step([batch_pair], meter, next(counter))

    return one, training.step, meter
