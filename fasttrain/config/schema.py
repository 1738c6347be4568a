"""The config schema: typed sections, each option declared once, on its field.

A field's metadata carries its flag, help, choices and bounds (``option``). The command line and the
YAML reader (``cli.py``) and the resolved-config writer are built from these fields, so a flag
cannot exist without a config key or the other way round. ``auto`` values (None here, or the
string "auto") are filled in one pass by ``resolve.py`` once the processes are up.

This module imports nothing of the package and nothing heavy: it is the leaf every other module
may read.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
KERNELS = ("normalize", "sgd", "xent", "maxpool")  # --triton-kernels names, in canonical order


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line and in YAML."""

    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False  # None is allowed (YAML null; "auto"/"none" on the command line)
    # other spellings of the flag: torchvision's reference train.py's and timm's, same meaning
    aliases: tuple[str, ...] = ()
    # (other spelling, value) pairs of choices, e.g. torchvision's "cosineannealinglr"
    synonyms: tuple[tuple[str, str], ...] = ()
    # a string of this many ':'-separated integers (YAML may give them as a list); 0: any string
    parts: int = 0
    metavar: str | None = None  # --help's name for the value (default: the flag's, upper case)
    # (a float must also be finite: NaN and infinity are refused for every option)
    key: str = ""  # "section.field": filled by options()
    type: type = str  # int, float, str or bool: from the field's annotation


def option(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A config field declared with its option (see ``Option``)."""
    return field(default=default, metadata={"option": Option(flag, help, **kw)})


@dataclass
class DataConfig:
    path: str | None = option(
        None,
        "--data",
        "dataset root holding train/ and val/ class folders (ImageFolder layout); omit it to "
        "use the built-in sample dataset",
        nullable=True,
    )
    loader: str = option(
        "auto",
        "--loader",
        "input pipeline: dali (NVIDIA DALI: decode and augment on the GPU, or on the CPU "
        "without one; needs the dali extra), torchvision (ImageFolder, CPU decode, uint8 to the "
        "GPU), synthetic (fixed random tensors on the device, for benchmarks), or auto: dali "
        "where DALI and a GPU are present, else torchvision",
        choices=("auto", "dali", "torchvision", "synthetic"),
    )
    exclude_list: str | None = option(
        None,
        "--exclude-list",
        "images to leave out, one path per line, as `python -m fasttrain check-data DIR` writes "
        "(default: the list check-data wrote for --data, if there is one)",
        nullable=True,
    )
    image_size: int = option(
        224,
        "--image-size",
        "train crop size in pixels; val resizes the shorter side to size/0.875 and "
        "center-crops this size, unless --val-resize-size / --val-crop-size say otherwise",
        minimum=16,
        aliases=("--train-crop-size",),
    )
    progressive_resizing: str | None = option(
        None,
        "--progressive-resizing",
        "train at a size that grows over the run, FFCV's progressive resizing: START px up to "
        "epoch FROM_EPOCH, END px from epoch TO_EPOCH, linearly in between rounded to a "
        "multiple of 32 (epochs count from 0; FFCV's ResNet-50 recipes use 160:192). It takes "
        "the place of --image-size for training, and val's default crop is END. Each size "
        "compiles and captures its own step once; --batch-size auto finds each size's batch "
        "(--batch-sizes). YAML: the same string, or a list of the four numbers; none: off",
        nullable=True,
        parts=4,
        metavar="START:END:FROM_EPOCH:TO_EPOCH",
    )
    auto_augment: str = option(
        "none",
        "--auto-augment",
        "train: TrivialAugment Wide (ta_wide) or RandAugment (ra: 2 ops, magnitude 9) on each "
        "crop, on the GPU in DALI's pipeline or by torchvision's transforms in the torchvision "
        "loader; none: off",
        choices=("none", "ta_wide", "ra"),
    )
    val_resize_size: int | None = option(
        None,
        "--val-resize-size",
        "val: resize the shorter side to this many pixels before the center crop (default: "
        "the crop size / 0.875, 256 for 224)",
        minimum=16,
        nullable=True,
    )
    val_crop_size: int | None = option(
        None,
        "--val-crop-size",
        "val: the center crop in pixels (default: --image-size)",
        minimum=16,
        nullable=True,
    )
    workers: int | None = option(
        None,
        "--workers",
        "torchvision loader worker processes per GPU (default: one per CPU core, at most 16)",
        minimum=0,
        nullable=True,
        aliases=("-j",),
    )
    synthetic_steps: int = option(
        0,
        "--synthetic-steps",
        "steps per epoch with --loader synthetic; 0 means an ImageNet-sized epoch "
        "(1,281,167 images)",
        minimum=0,
    )
    dali_threads: int = option(
        8, "--dali-threads", "with --loader dali: CPU threads per process", minimum=1
    )
    dali_prefetch: int = option(
        4,
        "--dali-prefetch",
        "with --loader dali: batches decoded ahead of the step (DALI's prefetch queue depth; "
        "deeper than DALI's 2 so that decode sharing the GPU with the step never makes it wait)",
        minimum=1,
    )
    dali_hw_decoder_load: float = option(
        0.99,
        "--dali-hw-decoder-load",
        "with --loader dali on a GPU: share of JPEGs sent to the hardware JPEG decoder (0 to 1; "
        "the rest decode on the GPU's SMs)",
        minimum=0,
        maximum=1,
    )


@dataclass
class ModelConfig:
    arch: str = option(
        "resnet50",
        "--arch",
        "model architecture (torchvision, weights=None)",
        choices=ARCHS,
        aliases=("--model",),
    )
    num_classes: int | None = option(
        None,
        "--num-classes",
        "output classes (default: the number of class folders in train/, or 1000 for "
        "synthetic data)",
        minimum=2,
        nullable=True,
    )
    channels_last: bool = option(
        True,
        "--channels-last",
        "NHWC memory format for the model and inputs (faster convolutions on tensor cores)",
    )
    zero_init_residual: bool = option(
        True,
        "--zero-init-residual",
        "start each residual block's last BatchNorm scale at zero, so every block starts as the "
        "identity (Goyal et al. 2017; timm's ResNet default); steadies the first steps",
    )
    weights: str | None = option(
        None,
        "--weights",
        "start from these weights: a state dict file (torchvision's, timm's, an export, or a "
        "fasttrain checkpoint). A classifier for another number of classes is replaced by a new "
        "one (fine-tuning); anything else that does not fit is an error. Nothing is downloaded",
        nullable=True,
    )
    fused_bn: bool = option(
        False,
        "--fused-bn",
        "fold BatchNorm into the convolutions: each convolution sums the next BN's statistics "
        "as it writes its output, so BN reads each activation once (to normalise) instead of "
        "twice. On a GPU it trains in fp16 (--amp fp16) and needs "
        "the cuDNN frontend (pip install --no-deps nvidia-cudnn-frontend); on the CPU it runs "
        "the same decomposition in plain PyTorch. The weights and checkpoints stay "
        "torchvision's",
    )
    cudnn_bn: bool = option(
        False,
        "--cudnn-bn",
        "run each BatchNorm, with the residual add and ReLU after it, as cuDNN's fused "
        "BatchNorm kernels (forward and backward) instead of the ones torch.compile generates. "
        "bf16 or fp16, channels_last; on a GPU it needs the cuDNN frontend (pip install "
        "--no-deps nvidia-cudnn-frontend); on the CPU it runs the same op in plain PyTorch. "
        "The weights and checkpoints stay torchvision's. Under --compile it measured 1.3%% "
        "slower than the kernels torch.compile generates (ResNet-50, bf16, one H200)",
    )


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


@dataclass
class TrainConfig:
    epochs: int = option(
        90, "--epochs", "number of epochs; the LR schedule spans them all", minimum=1
    )
    max_steps: int | None = option(
        None,
        "--max-steps",
        "stop after this many optimizer steps (the LR schedule still follows --epochs, so a "
        "stopped run can be resumed exactly)",
        minimum=1,
        nullable=True,
    )
    batch_size: int | None = option(
        256,
        "--batch-size",
        "images per process per micro-step; the global batch is batch-size x processes x "
        "accum-steps. auto: the largest that fits this GPU with 10%% of its memory left free, "
        "found by running the real step (capture included) at growing sizes before training "
        "(with --progressive-resizing, at each size: --batch-sizes)",
        minimum=1,
        nullable=True,
        aliases=("-b",),
    )
    batch_sizes: str | None = option(
        None,
        "--batch-sizes",
        "with --progressive-resizing, a train size's own batch per process, as SIZE:BATCH "
        "pairs (e.g. 160:1024,192:704); the other sizes take --batch-size. An epoch at such a "
        "size takes fewer, larger steps, and its LR follows its global batch (--lr-scaling "
        "linear). --batch-size auto fills it in, measuring each size",
        nullable=True,
        metavar="SIZE:BATCH[,SIZE:BATCH...]",
    )
    accum_steps: int = option(
        1,
        "--accum-steps",
        "micro-batches accumulated per optimizer step (gradient accumulation)",
        minimum=1,
    )
    amp: str | None = option(
        None,
        "--amp",
        "mixed precision: bf16, fp16 (with a GradScaler) or off (default: bf16 on a GPU, off "
        "on the CPU)",
        choices=("bf16", "fp16", "off"),
        nullable=True,
    )
    compile: bool = option(
        False, "--compile", "torch.compile the model for training and evaluation"
    )
    compile_mode: str = option(
        "auto",
        "--compile-mode",
        "torch.compile mode. auto: on a GPU, default plus inductor's coordinate_descent_tuning "
        "(its first start tunes every Triton kernel, minutes for ResNet-50; later starts reuse "
        "inductor's cache); on the CPU and for the built-in sample demo, where tuning would "
        "outlast the run, default alone. The modes that capture CUDA graphs of their own "
        "(reduce-overhead, max-autotune) cannot be combined with --cuda-graphs",
        choices=COMPILE_MODES,
    )
    inductor_options: str | None = option(
        None,
        "--inductor-options",
        "comma-separated inductor settings for --compile, NAME or NAME=VALUE "
        "(torch._inductor.config), e.g. conv_1x1_as_mm,max_autotune; 'none' for none. Under "
        "--compile-mode auto on a GPU, coordinate_descent_tuning joins them unless they set it",
        nullable=True,
    )
    cuda_graphs: bool = option(
        False,
        "--cuda-graphs",
        "capture the whole training step (forward, backward, all-reduce, optimizer, LR, "
        "metrics) in one CUDA graph and replay it: the host launches one graph per step; with "
        "--compile or without",
    )
    triton_kernels: str = option(
        "auto",
        "--triton-kernels",
        "fasttrain's Triton kernels to use instead of the torch path, comma-separated: "
        "normalize (the torchvision loader's uint8 -> normalised input, one pass), sgd (the "
        "optimizer over flat buffers, one launch), xent (fused softmax cross-entropy with label "
        "smoothing), maxpool (the stem's max-pool, forward and backward), none, or auto: those "
        "measured faster than the torch path in the step (maxpool with channels_last on a GPU; "
        "normalize with the torchvision loader on a GPU)",
    )
    strategy: str = option(
        "auto",
        "--strategy",
        "data parallelism: ddp (DistributedDataParallel, one process per GPU: torchrun or "
        "--nproc-per-node), dp (nn.DataParallel over every visible GPU in one process: the "
        "classic baseline), none, or auto: ddp with several processes, else none",
        choices=("auto", "ddp", "dp", "none"),
    )
    bucket_cap_mb: int | None = option(
        None,
        "--bucket-cap-mb",
        "DDP gradient bucket size in MB (all-reduces start per bucket during the backward); "
        "auto: 100 when every rank is on one node (fewer, larger all-reduces inside the graph), "
        "25 (PyTorch's default, more overlap for a slower network) across nodes",
        minimum=1,
        nullable=True,
    )
    broadcast_buffers: bool = option(
        False,
        "--broadcast-buffers",
        "DDP: copy rank 0's BatchNorm statistics to every rank on every forward (off: each rank "
        "keeps its own, and they are averaged before each evaluation and checkpoint)",
    )
    sync_bn: bool = option(
        False,
        "--sync-bn",
        "DDP: SyncBatchNorm, batch statistics over the global batch (an all-gather per BN layer)",
    )
    ddp_comm_hook: str = option(
        "none",
        "--ddp-comm-hook",
        "DDP gradient all-reduce: none (fp32, exact) or PyTorch's bf16 / fp16 compression hook "
        "(each bucket cast to 16 bits, all-reduced, cast back: half the bytes on the wire, at "
        "16-bit precision of the averaged gradient; for links slower than NVLink)",
        choices=("none", "bf16", "fp16"),
    )
    dist_timeout: int = option(
        600,
        "--dist-timeout",
        "seconds a collective may wait before the run fails with an error naming the rank and "
        "the collective, instead of hanging",
        minimum=1,
    )
    on_nan: str = option(
        "stop",
        "--on-nan",
        "a non-finite loss (checked at log steps, from a device counter: no extra sync): stop "
        "writes nonfinite.json (step, LR, last finite loss) and exits 3; skip restores the "
        "newest checkpoint in place and trains on from the current step",
        choices=("stop", "skip"),
    )
    device: str = option("auto", "--device", "device to train on", choices=("auto", "cuda", "cpu"))
    random_erase: float = option(
        0.0,
        "--random-erase",
        "random erasing: the share of train images in which a random box (2-33%% of the image, "
        "aspect 0.3-3.3) is set to the mean colour, on the device inside the step, as "
        "torchvision's RandomErasing (0: off; torchvision's v2 recipe: 0.25)",
        minimum=0,
        maximum=1,
    )
    mixup_alpha: float = option(
        0.0,
        "--mixup-alpha",
        "mixup: blend each batch with itself rolled by one, lam ~ Beta(alpha, alpha), on the "
        "device inside the step; soft targets in the loss (0: off; torchvision's v2 recipe: 0.2)",
        minimum=0,
        aliases=("--mixup",),
    )
    cutmix_alpha: float = option(
        0.0,
        "--cutmix-alpha",
        "CutMix: paste a box of the rolled batch, its area 1 - lam, lam ~ Beta(alpha, alpha) "
        "(0: off; torchvision's v2 recipe: 1.0). With --mixup-alpha too, each batch takes one",
        minimum=0,
        aliases=("--cutmix",),
    )
    mixup_prob: float = option(
        1.0, "--mixup-prob", "share of batches that mixup/CutMix mixes", minimum=0, maximum=1
    )
    mixup_switch_prob: float = option(
        0.5,
        "--mixup-switch-prob",
        "with both --mixup-alpha and --cutmix-alpha: the share of mixed batches that take CutMix",
        minimum=0,
        maximum=1,
    )
    model_ema: bool = option(
        False,
        "--model-ema",
        "keep an exponential moving average of the weights, updated on the device after each "
        "optimizer step (inside the CUDA graph); it is evaluated beside the model (ema_top1) "
        "and checkpointed, and `export --ema` writes it",
    )
    model_ema_decay: float = option(
        0.9998,
        "--model-ema-decay",
        "--model-ema: the average's decay per update",
        minimum=0,
        maximum=1,
    )
    model_ema_steps: int = option(
        1, "--model-ema-steps", "--model-ema: optimizer steps between updates", minimum=1
    )
    model_ema_warmup: bool = option(
        False,
        "--model-ema-warmup",
        "--model-ema: timm's warm-up, decay = min(decay, (1 + n) / (10 + n)) after n updates, "
        "so the first weights do not linger",
    )
    deterministic: bool = option(
        False,
        "--deterministic",
        "reproducible runs: cuDNN's deterministic algorithms without autotuning, "
        "torch.use_deterministic_algorithms (an op that has no deterministic kernel warns in "
        "the log), CUBLAS_WORKSPACE_CONFIG=:4096:8 and inductor's deterministic mode; the "
        "loaders follow --seed either way. Slower on a GPU: cuDNN and inductor cannot pick "
        "their fastest kernels",
    )
    seed: int = option(
        0,
        "--seed",
        "seed for initialisation, shuffling and augmentation",
        minimum=0,
        maximum=2**32 - 1,  # what numpy's and DALI's seeds take
    )


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
        "for TensorBoard (torch-tb-profiler) and Perfetto, and a breakdown of each step into "
        "compute, communication, data transfer, sync and idle",
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


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "run": RunConfig,
}


def _value_type(annotation: Any) -> type:
    """``int | None`` -> int: the type a value has when it is not None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def options() -> tuple[Option, ...]:
    """Every option, in declaration order, with its key and value type filled in."""
    found = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            o = f.metadata["option"]
            found.append(
                dataclasses.replace(o, key=f"{section}.{f.name}", type=_value_type(hints[f.name]))
            )
    return tuple(found)


OPTIONS = options()
OPTION_BY_KEY = {o.key: o for o in OPTIONS}
