"""The ``optim`` section: the optimizer, the LR and its schedule, the loss's smoothing."""

from __future__ import annotations

from dataclasses import dataclass

from fasttrain.config.option import option


@dataclass
class OptimConfig:
    lr: float = option(
        0.1,
        "--lr",
        "base learning rate per 256 images, scaled linearly to the global batch (Goyal et al. "
        "2017): the run uses --lr x global batch / 256, printed at start. torchvision's and "
        "timm's --lr is the rate itself: their --lr 0.5 at a global batch of 1024 is --lr 0.125 "
        "here, or --lr 0.5 --lr-scaling none",
        minimum=0,
    )
    lr_scaling: str = option(
        "linear",
        "--lr-scaling",
        "how --lr is read: linear (per 256 images, scaled to the global batch) or none (the "
        "rate itself, whatever the batch, as torchvision's train.py reads it)",
        choices=("linear", "none"),
    )
    momentum: float = option(0.9, "--momentum", "SGD momentum", minimum=0)
    weight_decay: float = option(1e-4, "--weight-decay", "L2 weight decay", minimum=0)
    bn_weight_decay: bool = option(
        True,
        "--bn-weight-decay",
        "apply weight decay to BatchNorm weights and biases (--no-bn-weight-decay exempts them)",
    )
    warmup_epochs: float = option(
        0.0,
        "--warmup-epochs",
        "linear LR warmup from 0, in epochs (applied per step)",
        minimum=0,
        aliases=("--lr-warmup-epochs",),
    )
    lr_schedule: str = option(
        "step",
        "--lr-schedule",
        "LR decay after warmup, applied per step: step (x --lr-gamma every --lr-step-epochs), "
        "cosine or poly (to zero at the end of --epochs; poly as (1 - progress) ** --lr-power, "
        "MLPerf's ResNet-50 schedule)",
        choices=("step", "cosine", "poly"),
        aliases=("--lr-scheduler", "--sched"),
        synonyms=(("steplr", "step"), ("cosineannealinglr", "cosine")),
    )
    lr_step_epochs: int = option(
        30,
        "--lr-step-epochs",
        "with --lr-schedule step: multiply the LR by --lr-gamma every this many epochs",
        minimum=1,
        aliases=("--lr-step-size",),
    )
    lr_gamma: float = option(
        0.1, "--lr-gamma", "with --lr-schedule step: the decay factor", minimum=0
    )
    clip_grad_norm: float | None = option(
        None,
        "--clip-grad-norm",
        "clip the gradients' total L2 norm to this before each update, on the device (fp16's "
        "scaled gradients are unscaled first); none: no clipping",
        minimum=0,
        nullable=True,
        aliases=("--clip-grad",),
    )
    lr_power: float = option(
        2.0, "--lr-power", "with --lr-schedule poly: the decay's power (MLPerf: 2)", minimum=0
    )
    label_smoothing: float = option(
        0.0,
        "--label-smoothing",
        "label smoothing for the cross-entropy loss",
        minimum=0,
        maximum=1,
        aliases=("--smoothing",),
    )
    opt: str = option(
        "sgd",
        "--opt",
        "optimizer: sgd (momentum, weight decay) or lars (layer-wise trust ratios for large "
        "global batches, as MLPerf's ResNet-50), both in torch's ops on every device; "
        "--triton-kernels sgd runs either as fasttrain's Triton kernel over flat buffers on one "
        "GPU process",
        choices=("sgd", "lars"),
    )
    lars_eta: float = option(0.001, "--lars-eta", "LARS trust coefficient", minimum=0)
