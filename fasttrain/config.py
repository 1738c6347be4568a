"""Typed config sections, built from defaults, then a YAML recipe, then command-line flags.

Each option is declared once in ``OPTIONS`` (flag, section, type, help, check); argparse, the YAML
validator and the resolved-config writer are all built from that table, so a flag can't exist
without a config key or the other way round. Only this module and ``distributed.py`` read the
environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fasttrain.errors import UserError

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
COMPILE_MODES = ("auto", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
# What --compile-mode auto compiles with on a GPU: the fastest measured on an H200 with
# --cuda-graphs (BENCHMARKS.md, one process, batch 256): "default" plus coordinate-descent tuning
# of inductor's Triton kernels, 7,316 img/s, against 6,931 for "default" alone and 7,243 for
# max-autotune-no-cudagraphs (the same tuning plus conv and matmul autotuning, which cuDNN and
# cuBLAS won almost everywhere). Its first compile tunes for about 5 minutes (cached after).
FASTEST_COMPILE_MODE = "default"
FASTEST_INDUCTOR_OPTIONS = "coordinate_descent_tuning"
# inductor settings --compile uses unless --inductor-options says otherwise (BENCHMARKS.md)
INDUCTOR_DEFAULTS: tuple[str, ...] = ()


@dataclass
class DataConfig:
    path: str | None = None  # None: the built-in sample dataset
    loader: str = "auto"  # dali where DALI and a GPU are present, else torchvision
    exclude_list: str | None = None  # None: check-data's list for --data, if it wrote one
    image_size: int = 224
    workers: int | None = None  # None: one per CPU, at most 16
    synthetic_steps: int = 0  # steps per epoch of the synthetic loader; 0: an ImageNet-sized epoch
    dali_threads: int = 8
    dali_hw_decoder_load: float = 0.99
    dali_pipelines: int = 1
    dali_prefetch: int = 4  # DALI's prefetch queue depth: batches decoded ahead of the step
    dali_handoff: str = "host"  # host: launch the step once its batch is decoded; stream: at once
    dali_antialias: bool = True  # the train resize's antialiasing filter (off: NVIDIA's reference)


@dataclass
class ModelConfig:
    arch: str = "resnet50"
    num_classes: int | None = None  # None: the number of class folders in train/
    channels_last: bool = True
    zero_init_residual: bool = True


@dataclass
class OptimConfig:
    lr: float = 0.1  # per 256 images; scaled linearly to the global batch
    momentum: float = 0.9
    weight_decay: float = 1e-4
    bn_weight_decay: bool = True
    warmup_epochs: float = 0.0
    lr_schedule: str = "step"
    lr_step_epochs: int = 30
    lr_gamma: float = 0.1
    label_smoothing: float = 0.0
    opt: str = "sgd"
    lars_eta: float = 0.001


@dataclass
class TrainConfig:
    epochs: int = 90
    max_steps: int | None = None
    batch_size: int | None = 256  # per process; None: auto (the largest that fits, measured)
    accum_steps: int = 1
    amp: str | None = None  # None: bf16 on a GPU, off on the CPU
    compile: bool = False
    compile_mode: str = "auto"  # FASTEST_COMPILE_MODE (+ its options) on a GPU, except the demo
    inductor_options: str | None = None  # None: INDUCTOR_DEFAULTS under --compile
    cuda_graphs: bool = False
    triton_kernels: str = "auto"  # comma list of KERNELS, none, or auto: measured faster and sound
    strategy: str = "auto"  # ddp with several processes, else none
    bucket_cap_mb: int | None = None  # auto: ddp_bucket_cap_mb()
    broadcast_buffers: bool = False
    sync_bn: bool = False
    ddp_compile: str = "ddp-optimizer"
    ddp_comm_hook: str = "none"
    dist_timeout: int = 600
    on_nan: str = "stop"
    device: str = "auto"
    seed: int = 0


@dataclass
class RunConfig:
    output_dir: str | None = None  # None: runs/<name or time>
    name: str | None = None
    resume: str | None = None
    log_every: int = 50
    log_sync: bool = False  # read each log step's metrics at once, with a host sync
    eval_every: int = 1
    ckpt_every_steps: int = 0
    keep_checkpoints: int = 3
    profile: bool = False
    profile_wait: int = 20
    profile_warmup: int = 2
    profile_active: int = 5
    profile_repeat: int = 1


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Any]]) -> Config:
        return cls(**{name: SECTIONS[name](**values) for name, values in d.items()})


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "run": RunConfig,
}


@dataclass(frozen=True)
class Option:
    """One option: its flag, where it lives in the config, how to parse and check it."""

    flag: str
    key: str  # "section.field"
    type: type  # int, float, str or bool
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False  # the value may be null (YAML) / "auto" style defaults
    parse: Callable[[str], Any] | None = None  # custom parser for the flag's string


def _int_or_none(s: str) -> int | None:
    return None if s.lower() in ("none", "auto", "null") else int(s)


OPTIONS: tuple[Option, ...] = (
    # data and model
    Option(
        "--data",
        "data.path",
        str,
        "dataset root holding train/ and val/ class folders "
        "(ImageFolder layout); omit it to use the built-in sample dataset",
        nullable=True,
    ),
    Option(
        "--loader",
        "data.loader",
        str,
        "input pipeline: dali (NVIDIA DALI: decode and augment on the GPU, or on the CPU "
        "without one; needs the dali extra), torchvision (ImageFolder, CPU decode, uint8 to the "
        "GPU), synthetic (fixed random tensors on the device, for benchmarks), or auto: dali "
        "where DALI and a GPU are present, else torchvision",
        choices=("auto", "dali", "torchvision", "synthetic"),
    ),
    Option(
        "--exclude-list",
        "data.exclude_list",
        str,
        "images to leave out, one path per line, as `python -m fasttrain check-data DIR` writes "
        "(default: the list check-data wrote for --data, if there is one)",
        nullable=True,
    ),
    Option(
        "--image-size",
        "data.image_size",
        int,
        "train crop size in pixels; val resizes the "
        "shorter side to size/0.875 and center-crops this size",
        minimum=16,
    ),
    Option(
        "--workers",
        "data.workers",
        int,
        "data loader worker processes per GPU (default: one per CPU core, at most 16)",
        minimum=0,
        nullable=True,
        parse=_int_or_none,
    ),
    Option(
        "--synthetic-steps",
        "data.synthetic_steps",
        int,
        "steps per epoch with --loader "
        "synthetic; 0 means an ImageNet-sized epoch (1,281,167 images)",
        minimum=0,
    ),
    Option(
        "--dali-threads",
        "data.dali_threads",
        int,
        "with --loader dali: CPU threads per process, shared by its train pipelines",
        minimum=1,
    ),
    Option(
        "--dali-pipelines",
        "data.dali_pipelines",
        int,
        "with --loader dali: train pipelines per process, each a part of the shard, taking "
        "turns batch by batch (for a host where one pipeline's CPU side cannot keep up). On an "
        "H200 2 measured 2%% slower than 1 end to end, so 1 is the default (BENCHMARKS.md)",
        minimum=1,
    ),
    Option(
        "--dali-prefetch",
        "data.dali_prefetch",
        int,
        "with --loader dali: batches each train pipeline decodes ahead of the step (DALI's "
        "prefetch_queue_depth). 4 measured 1-3%% faster than DALI's 2 end to end on H200s, "
        "one GPU and DDP on two (BENCHMARKS.md): fewer batches arrive after the step wants them",
        minimum=1,
    ),
    Option(
        "--dali-handoff",
        "data.dali_handoff",
        str,
        "with --loader dali on a GPU: host (the default) launches each step once its batch is "
        "decoded; stream launches it at once, ordered after the decode on the GPU, so the host "
        "never waits for the GPU. Measured within 0.6%% of host, and the same under DDP "
        "(BENCHMARKS.md)",
        choices=("host", "stream"),
    ),
    Option(
        "--dali-antialias",
        "data.dali_antialias",
        bool,
        "with --loader dali: the train resize's antialiasing filter, on by default (as "
        "torchvision's resize, which always antialiases PIL images). --no-dali-antialias "
        "resizes bilinearly without it, as NVIDIA's ResNet-50 reference pipeline does: less "
        "GPU work beside the step (0.12 ms per step on an H200; end to end within noise)",
    ),
    Option(
        "--dali-hw-decoder-load",
        "data.dali_hw_decoder_load",
        float,
        "with --loader dali on a GPU: share of JPEGs sent to the hardware decoder (0 to 1); "
        "0.99 gave 21,500 img/s against 13,700 at 0.65 on one H200 (shared/device/README.md)",
        minimum=0,
        maximum=1,
    ),
    Option(
        "--arch", "model.arch", str, "model architecture (torchvision, weights=None)", choices=ARCHS
    ),
    Option(
        "--num-classes",
        "model.num_classes",
        int,
        "output classes (default: the number of "
        "class folders in train/, or 1000 for synthetic data)",
        minimum=2,
        nullable=True,
        parse=_int_or_none,
    ),
    Option(
        "--channels-last",
        "model.channels_last",
        bool,
        "NHWC memory format for the model and inputs (faster convolutions on tensor cores)",
    ),
    Option(
        "--zero-init-residual",
        "model.zero_init_residual",
        bool,
        "start each residual block's last BatchNorm scale at zero, so every block starts as the "
        "identity (Goyal et al. 2017; timm's ResNet default); steadies the first steps",
    ),
    # length
    Option(
        "--epochs",
        "train.epochs",
        int,
        "number of epochs; the LR schedule spans them all",
        minimum=1,
    ),
    Option(
        "--max-steps",
        "train.max_steps",
        int,
        "stop after this many optimizer steps (the LR "
        "schedule still follows --epochs, so a stopped run can be resumed exactly)",
        minimum=1,
        nullable=True,
        parse=_int_or_none,
    ),
    # batch and LR
    Option(
        "--batch-size",
        "train.batch_size",
        int,
        "images per process per micro-step; "
        "the global batch is batch-size x processes x accum-steps. auto: the largest that fits "
        "this GPU with 10%% of its memory left free, found by running the real step (capture "
        "included) at growing sizes before training (about a minute)",
        minimum=1,
        nullable=True,
        parse=lambda s: None if s.lower() == "auto" else int(s),
    ),
    Option(
        "--lr",
        "optim.lr",
        float,
        "base learning rate per 256 images, scaled linearly to the global batch",
        minimum=0,
    ),
    Option("--momentum", "optim.momentum", float, "SGD momentum", minimum=0),
    Option("--weight-decay", "optim.weight_decay", float, "L2 weight decay", minimum=0),
    Option(
        "--bn-weight-decay",
        "optim.bn_weight_decay",
        bool,
        "apply weight decay to BatchNorm weights and biases (--no-bn-weight-decay exempts them)",
    ),
    Option(
        "--warmup-epochs",
        "optim.warmup_epochs",
        float,
        "linear LR warmup from 0, in epochs (applied per step)",
        minimum=0,
    ),
    Option(
        "--lr-schedule",
        "optim.lr_schedule",
        str,
        "LR decay after warmup, applied per step",
        choices=("step", "cosine"),
    ),
    Option(
        "--lr-step-epochs",
        "optim.lr_step_epochs",
        int,
        "with --lr-schedule step: multiply the LR by --lr-gamma every this many epochs",
        minimum=1,
    ),
    Option(
        "--lr-gamma",
        "optim.lr_gamma",
        float,
        "with --lr-schedule step: the decay factor",
        minimum=0,
    ),
    # training
    Option(
        "--label-smoothing",
        "optim.label_smoothing",
        float,
        "label smoothing for the cross-entropy loss",
        minimum=0,
    ),
    Option(
        "--opt",
        "optim.opt",
        str,
        "optimizer: sgd (momentum, weight decay) or lars (layer-wise trust ratios for large "
        "global batches, as MLPerf's ResNet-50; a Triton kernel, so a GPU is needed)",
        choices=("sgd", "lars"),
    ),
    Option("--lars-eta", "optim.lars_eta", float, "LARS trust coefficient", minimum=0),
    Option(
        "--accum-steps",
        "train.accum_steps",
        int,
        "micro-batches accumulated per optimizer step (gradient accumulation)",
        minimum=1,
    ),
    Option(
        "--amp",
        "train.amp",
        str,
        "mixed precision: bf16, fp16 (with a GradScaler) or off "
        "(default: bf16 on a GPU, off on the CPU)",
        choices=("bf16", "fp16", "off"),
        nullable=True,
    ),
    Option(
        "--compile", "train.compile", bool, "torch.compile the model for training and evaluation"
    ),
    Option(
        "--compile-mode",
        "train.compile_mode",
        str,
        "torch.compile mode. auto: on a GPU, default plus inductor's coordinate_descent_tuning, "
        "the fastest measured (its first start tunes every Triton kernel, about 5 minutes on "
        "an H200; later starts reuse inductor's cache); on the CPU and for the built-in sample "
        "demo, where tuning would outlast the run, default alone. The modes that capture CUDA "
        "graphs of their own (reduce-overhead, max-autotune) cannot be combined with "
        "--cuda-graphs",
        choices=COMPILE_MODES,
    ),
    Option(
        "--inductor-options",
        "train.inductor_options",
        str,
        "comma-separated inductor settings for --compile, NAME or NAME=VALUE (torch._inductor."
        "config), e.g. conv_1x1_as_mm,max_autotune; 'none' for none. Default: "
        f"{','.join(INDUCTOR_DEFAULTS) or 'none'}, and under --compile-mode auto on a GPU "
        f"{FASTEST_INDUCTOR_OPTIONS} joins them unless they set it (the fastest measured on an "
        "H200: BENCHMARKS.md)",
        nullable=True,
    ),
    Option(
        "--cuda-graphs",
        "train.cuda_graphs",
        bool,
        "capture the whole training step (forward, backward, optimizer, LR, metrics) in one CUDA "
        "graph and replay it: the host launches one graph per step; with --compile or without",
    ),
    Option(
        "--on-nan",
        "train.on_nan",
        str,
        "a non-finite loss (checked at log steps, from a device counter: no extra sync): stop "
        "writes nonfinite.json (step, LR, last finite loss) and exits 3; skip restores the "
        "newest checkpoint in place and trains on from the current step",
        choices=("stop", "skip"),
    ),
    Option(
        "--triton-kernels",
        "train.triton_kernels",
        str,
        "fasttrain's Triton kernels to use instead of the torch path, comma-separated: "
        "normalize (the torchvision loader's uint8 -> normalised input, one pass), sgd (the "
        "optimizer over flat buffers, one launch), xent (fused softmax cross-entropy with label "
        "smoothing), maxpool (the stem's max-pool, forward and backward), none, or auto: the "
        "ones measured faster than the torch path on an H200 and passing the GPU tests "
        "(BENCHMARKS.md): on a GPU, maxpool (2.4x inductor's, +1.3%% per step) with "
        "channels_last, and normalize with the torchvision loader. sgd measured 2.4x torch's "
        "fused SGD alone, a fraction of a percent of the step; xent measured level with "
        "torch: both stay options",
    ),
    Option(
        "--strategy",
        "train.strategy",
        str,
        "data parallelism: ddp (DistributedDataParallel, one process per GPU: torchrun or "
        "--nproc-per-node), dp (nn.DataParallel over every visible GPU in one process: the "
        "classic baseline), none, or auto: ddp with several processes, else none",
        choices=("auto", "ddp", "dp", "none"),
    ),
    Option(
        "--bucket-cap-mb",
        "train.bucket_cap_mb",
        int,
        "DDP gradient bucket size in MB (all-reduces start per bucket during the backward); "
        "auto (default): 100 when every rank is on one node (measured 1.7%% faster than 25 "
        "with DALI and the graphed step on two H200s, BENCHMARKS.md), 25 (PyTorch's default, "
        "more overlap for a slower network) across nodes",
        minimum=1,
        nullable=True,
        parse=_int_or_none,
    ),
    Option(
        "--broadcast-buffers",
        "train.broadcast_buffers",
        bool,
        "DDP: copy rank 0's BatchNorm statistics to every rank on every forward (off: each rank "
        "keeps its own, and they are averaged before each evaluation and checkpoint)",
    ),
    Option(
        "--sync-bn",
        "train.sync_bn",
        bool,
        "DDP: SyncBatchNorm, batch statistics over the global batch (an all-gather per BN layer)",
    ),
    Option(
        "--ddp-compile",
        "train.ddp_compile",
        str,
        "DDP with --compile: ddp-optimizer (dynamo splits the graph at bucket boundaries) or "
        "compiled-autograd (the backward is compiled with DDP's all-reduces in it)",
        choices=("ddp-optimizer", "compiled-autograd"),
    ),
    Option(
        "--ddp-comm-hook",
        "train.ddp_comm_hook",
        str,
        "DDP gradient all-reduce: none (fp32, exact) or PyTorch's bf16 / fp16 compression hook "
        "(each bucket cast to 16 bits, all-reduced, cast back: half the bytes on the wire, at "
        "16-bit precision of the averaged gradient; +0.3%% and +0.05%% on two H200s over "
        "NVLink, within noise, BENCHMARKS.md: for slower links)",
        choices=("none", "bf16", "fp16"),
    ),
    Option(
        "--dist-timeout",
        "train.dist_timeout",
        int,
        "seconds a collective may wait before the run fails with an error naming the rank and "
        "the collective, instead of hanging",
        minimum=1,
    ),
    Option("--device", "train.device", str, "device to train on", choices=("auto", "cuda", "cpu")),
    Option("--seed", "train.seed", int, "seed for initialisation, shuffling and augmentation"),
    # run control
    Option(
        "--output-dir",
        "run.output_dir",
        str,
        "run directory for checkpoints, logs and TensorBoard (default: runs/<name or time>)",
        nullable=True,
    ),
    Option("--name", "run.name", str, "run name, used for the default --output-dir", nullable=True),
    Option(
        "--resume",
        "run.resume",
        str,
        "checkpoint to resume from, or 'auto' for the newest valid checkpoint in --output-dir",
        nullable=True,
    ),
    Option(
        "--log-every",
        "run.log_every",
        int,
        "optimizer steps between log steps. A log step reads the interval before it, whose "
        "work is done, so it never waits for the GPU: each log line comes one interval late",
        minimum=1,
    ),
    Option(
        "--log-sync",
        "run.log_sync",
        bool,
        "read each log step's metrics at once, as torchvision's reference script does: the log "
        "line comes without delay, but every log step waits for the GPU to finish its queue "
        "(a host sync; the simple reference for the default)",
    ),
    Option(
        "--eval-every", "run.eval_every", int, "epochs between evaluations (0: never)", minimum=0
    ),
    Option(
        "--ckpt-every-steps",
        "run.ckpt_every_steps",
        int,
        "also checkpoint every this many optimizer steps (0: only at the end of each epoch)",
        minimum=0,
    ),
    Option(
        "--profile",
        "run.profile",
        bool,
        "profile with torch.profiler (CPU and CUDA): traces per rank under <output-dir>/profile "
        "for TensorBoard (torch-tb-profiler) and Perfetto, and a breakdown of each step into "
        "compute, communication, data transfer, sync and idle",
    ),
    Option(
        "--profile-wait",
        "run.profile_wait",
        int,
        "--profile: steps to skip before each cycle (past compile and CUDA-graph capture)",
        minimum=0,
    ),
    Option("--profile-warmup", "run.profile_warmup", int, "--profile: warm-up steps", minimum=0),
    Option("--profile-active", "run.profile_active", int, "--profile: steps recorded", minimum=1),
    Option(
        "--profile-repeat",
        "run.profile_repeat",
        int,
        "--profile: cycles of wait, warm-up and active steps (0: until the run ends)",
        minimum=0,
    ),
    Option(
        "--keep-checkpoints",
        "run.keep_checkpoints",
        int,
        "how many recent checkpoints to keep",
        minimum=1,
    ),
)
OPTION_BY_KEY = {o.key: o for o in OPTIONS}


def config_dir() -> Path:
    """The built-in recipes: configs/ in a source checkout, else the installed package data."""
    repo = Path(__file__).resolve().parent.parent / "configs"
    if repo.is_dir():
        return repo
    from importlib.resources import files

    return Path(str(files("fasttrain.configs")))


def cache_dir() -> Path:
    """Where the sample dataset and other generated files live: $FASTTRAIN_CACHE or ~/.cache."""
    env = os.environ.get("FASTTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fasttrain"


def _check(opt: Option, value: Any, where: str) -> Any:
    """Type-check and range-check one value; ``where`` names the flag or the YAML key and file."""
    if value is None:
        if opt.nullable:
            return None
        raise UserError(f"{where}: a value is required")
    if opt.type is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
    elif opt.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
    elif opt.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: expected a number, got {value!r}")
        value = float(value)
    elif not isinstance(value, str):
        raise UserError(f"{where}: expected a string, got {value!r}")
    if opt.choices is not None and value not in opt.choices:
        raise UserError(
            f"{where}: {value!r} is not allowed; choose one of {', '.join(opt.choices)}"
        )
    if opt.minimum is not None and value < opt.minimum:
        raise UserError(f"{where} must be at least {opt.minimum:g} (got {value})")
    if opt.maximum is not None and value > opt.maximum:
        raise UserError(f"{where} must be at most {opt.maximum:g} (got {value})")
    return value


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe: two levels, ``section: {key: value}``; unknown keys are errors."""
    if not path.is_file():
        raise UserError(f"--config {path}: file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        line = f" (line {e.problem_mark.line + 1})" if getattr(e, "problem_mark", None) else ""
        raise UserError(f"--config {path}: not valid YAML{line}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--config {path}: expected sections ({', '.join(SECTIONS)}) at the top")
    values: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise UserError(f"{path}: unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise UserError(f"{path}: section {section!r} must map keys to values")
        allowed = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for k, v in body.items():
            key = f"{section}.{k}"
            if key not in OPTION_BY_KEY:
                raise UserError(
                    f"{path}: unknown key {key!r}; allowed in {section}: {', '.join(allowed)}"
                )
            values[key] = _check(OPTION_BY_KEY[key], v, f"{path}: {key}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fasttrain",
        description="Train an image classifier (ResNet-50 by default) on an ImageNet-style JPEG "
        "folder, or on the built-in sample dataset when --data is not given. Flags override the "
        "--config recipe, which overrides the defaults. Other commands: `python -m fasttrain env` "
        "reports hardware and software; `python -m fasttrain check-data DIR` finds undecodable "
        "images and writes the list training then leaves out; `python -m fasttrain "
        "profile-summary TRACE_DIR` recomputes a --profile run's step breakdown.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the recipe
    )
    p.add_argument(
        "--config",
        type=Path,
        help="YAML recipe (see configs/); flags override it. "
        "Default with no --data: configs/sample.yaml on a GPU, configs/sample_cpu.yaml "
        "on the CPU",
    )
    p.add_argument(
        "--nproc-per-node",
        dest="launch.nproc",
        metavar="N",
        type=int,
        help="launch N processes on this machine through torch.distributed.run (as torchrun "
        "--standalone does), one per GPU, training with DDP; for several machines use torchrun",
    )
    defaults = Config()
    groups = {name: p.add_argument_group(f"{name} (YAML section '{name}')") for name in SECTIONS}
    for opt in OPTIONS:
        section, name = opt.key.split(".")
        default = getattr(getattr(defaults, section), name)
        # argument_default=SUPPRESS hides argparse's own defaults, so write them in here
        help_text = opt.help + ("" if default is None else f" (default: {default})")
        group = groups[section]
        if opt.type is bool:
            group.add_argument(
                opt.flag, dest=opt.key, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            metavar = None if opt.choices else opt.flag.lstrip("-").upper().replace("-", "_")
            group.add_argument(
                opt.flag,
                dest=opt.key,
                metavar=metavar,
                type=opt.parse or opt.type,
                choices=opt.choices,
                help=help_text,
            )
    return p


def parse_args(argv: Sequence[str], cuda_available: bool) -> tuple[Config, list[str]]:
    """Defaults <- recipe <- flags. Returns the config and notes to show the user once."""
    parser = build_parser()
    try:
        ns = vars(parser.parse_args(list(argv)))
    except SystemExit as e:  # argparse already printed a one-line usage error
        raise SystemExit(2 if e.code else 0) from None
    notes: list[str] = []
    ns.pop("launch.nproc", None)  # __main__ launches the processes before parsing
    recipe: Path | None = ns.pop("config", None)
    if recipe is None and ns.get("data.path") is None and ns.get("data.loader") != "synthetic":
        recipe = config_dir() / ("sample.yaml" if cuda_available else "sample_cpu.yaml")
        if not cuda_available:
            notes.append(
                f"no CUDA GPU found: training the CPU-sized sample run ({recipe.name}: "
                "smaller images, fewer steps); pass --data and flags to change it"
            )
    values: dict[str, Any] = load_yaml(recipe) if recipe is not None else {}
    for key, v in ns.items():
        values[key] = _check(OPTION_BY_KEY[key], v, OPTION_BY_KEY[key].flag)
    cfg = Config()
    for key, v in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, v)
    return cfg, notes


def default_exclude_list(data_path: str | Path) -> Path:
    """Where ``check-data`` writes, and training looks for, the bad-file list of a dataset."""
    absolute = os.path.abspath(Path(data_path).expanduser())
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:12]
    return cache_dir() / "check-data" / f"{Path(absolute).name}-{digest}.txt"


def resolve(
    cfg: Config,
    cuda_available: bool,
    cpu_count: int | None = None,
    dali_available: bool | None = None,
    notes: list[str] | None = None,
) -> Config:
    """Fill the 'auto' values (device, AMP, loader, workers, bad-file list, output dir) so the
    saved config is explicit. Things the user should hear about once go into ``notes``."""
    t = cfg.train
    if t.device == "auto":
        t.device = "cuda" if cuda_available else "cpu"
    elif t.device == "cuda" and not cuda_available:
        raise UserError("--device cuda: no CUDA GPU is visible; use --device cpu or auto")
    if t.amp is None:
        t.amp = "bf16" if t.device == "cuda" else "off"
    if t.amp == "fp16" and t.device == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; use --amp bf16 or off on the CPU")
    if t.batch_size is None and t.device != "cuda":
        raise UserError(
            "--batch-size auto measures GPU memory by running the step; on the CPU give a "
            "number (e.g. --batch-size 32)"
        )
    if cfg.data.workers is None:
        cpus = cpu_count or len(os.sched_getaffinity(0))
        cfg.data.workers = min(16, cpus)
    _resolve_compile(t, notes, sample=cfg.data.path is None and cfg.data.loader != "synthetic")
    d = cfg.data
    if d.loader == "auto":
        if dali_available is None:
            from fasttrain.data.dali import dali_available as find_dali

            dali_available = find_dali()
        d.loader = "dali" if t.device == "cuda" and dali_available else "torchvision"
        if t.device == "cuda" and not dali_available and notes is not None:
            notes.append(
                "DALI is not installed, so the torchvision loader decodes on the CPU; pip install "
                '-e ".[dali]" (CUDA 12) or ".[dali-cu13]" (CUDA 13) decodes on the GPU'
            )
    if d.dali_handoff == "stream" and (d.loader != "dali" or t.device != "cuda"):
        d.dali_handoff = "host"  # recorded as what runs
        if notes is not None:
            notes.append(
                "--dali-handoff stream orders DALI's batches on a CUDA stream; this run has "
                f"{'no GPU' if t.device != 'cuda' else f'--loader {d.loader}'}, so it does "
                "not apply"
            )
    if not d.dali_antialias and d.loader != "dali":
        d.dali_antialias = True  # recorded as what runs
        if notes is not None:
            notes.append(
                f"--no-dali-antialias is the DALI loader's; --loader {d.loader} resizes with "
                "antialiasing"
            )
    if d.path is not None:
        d.path = str(Path(d.path).expanduser())
        found = default_exclude_list(d.path)
        if d.exclude_list is None and found.is_file():
            d.exclude_list = str(found)
    _resolve_kernels(cfg)  # after the loader: normalize is the torchvision loader's
    r = cfg.run
    if r.output_dir is None:
        r.output_dir = str(Path("runs") / (r.name or time.strftime("%Y%m%d-%H%M%S")))
    return cfg


def _resolve_compile(t: TrainConfig, notes: list[str] | None, sample: bool = False) -> None:
    """Check the compile and graph settings together; fill the mode and inductor defaults."""
    if t.compile_mode == "auto":
        fast = t.compile and t.device == "cuda" and not sample
        t.compile_mode = FASTEST_COMPILE_MODE if fast else "default"
        given, tuning = t.inductor_options, FASTEST_INDUCTOR_OPTIONS
        if fast and given is None:
            t.inductor_options = ",".join((tuning, *INDUCTOR_DEFAULTS))
        elif (
            fast  # the tuning joins --inductor-options, unless they set it themselves
            and given not in ("", "none")
            and not inductor_options(given).keys() & inductor_options(tuning).keys()
        ):
            t.inductor_options = f"{tuning},{given}"
    elif not t.compile and t.compile_mode != "default":
        raise UserError(f"--compile-mode {t.compile_mode}: add --compile to use it")
    if not t.compile:
        if t.inductor_options not in (None, "", "none"):
            raise UserError(f"--inductor-options {t.inductor_options}: add --compile to use it")
        t.inductor_options = None
    elif t.inductor_options is None:
        t.inductor_options = ",".join(INDUCTOR_DEFAULTS) or "none"
    if t.compile:
        inductor_options(t.inductor_options)  # a bad name or value fails now, not mid-compile
    if t.cuda_graphs and t.device != "cuda":
        t.cuda_graphs = False
        if notes is not None:
            notes.append("--cuda-graphs needs a CUDA GPU: training without CUDA graphs")
    if t.cuda_graphs and t.compile and t.compile_mode in ("reduce-overhead", "max-autotune"):
        raise UserError(
            f"--compile-mode {t.compile_mode} captures CUDA graphs of its own, which cannot nest "
            "in --cuda-graphs' whole-step graph: use --compile-mode max-autotune-no-cudagraphs "
            "or default with --cuda-graphs"
        )


KERNELS = ("normalize", "sgd", "xent", "maxpool")


def triton_kernels(text: str) -> set[str]:
    """The set ``--triton-kernels`` names; an unknown name is a one-line error. "auto" must be
    resolved first (``resolve_parallel``: it depends on the strategy)."""
    if text == "auto":
        raise ValueError("--triton-kernels auto is resolved by resolve_parallel before use")
    names = {k.strip() for k in text.split(",") if k.strip() and k.strip() != "none"}
    unknown = names - set(KERNELS)
    if unknown:
        raise UserError(
            f"--triton-kernels: unknown {', '.join(sorted(unknown))}; choose from "
            f"{', '.join(KERNELS)} or none"
        )
    return names


def _resolve_kernels(cfg: Config) -> None:
    t = cfg.train
    auto = t.triton_kernels == "auto"  # resolve_parallel picks them, once the strategy is known
    kernels = set() if auto else triton_kernels(t.triton_kernels)
    if (kernels or cfg.optim.opt == "lars") and t.device != "cuda":
        what = "--opt lars" if cfg.optim.opt == "lars" else "--triton-kernels"
        raise UserError(f"{what} runs Triton kernels, which need a CUDA GPU; leave it out here")
    if "normalize" in kernels and cfg.data.loader != "torchvision":
        raise UserError(
            f"--triton-kernels normalize is the torchvision loader's; --loader "
            f"{cfg.data.loader} does not use it"
        )
    if not auto:
        t.triton_kernels = ",".join(k for k in KERNELS if k in kernels) or "none"


# DDP-only settings: given without DDP (away from TrainConfig's defaults) they do nothing, and
# the user hears so, by flag
DDP_ONLY = ("bucket_cap_mb", "broadcast_buffers", "sync_bn", "ddp_comm_hook")  # TrainConfig fields


def resolve_parallel(
    cfg: Config, world_size: int, gpus: int, notes: list[str] | None = None
) -> Config:
    """Fill the 'auto' strategy from the launch, and refuse combinations that cannot work.
    DDP-only settings given to a run without DDP go into ``notes``."""
    t = cfg.train
    if t.strategy == "auto":
        t.strategy = "ddp" if world_size > 1 else "none"
    if t.triton_kernels == "auto":  # the kernels measured faster on an H200 (BENCHMARKS.md)
        gpu = t.device == "cuda"
        picked = {
            "normalize": gpu and cfg.data.loader == "torchvision",
            "maxpool": gpu and cfg.model.channels_last,  # its tiles read channels contiguously
        }
        t.triton_kernels = ",".join(k for k in KERNELS if picked.get(k)) or "none"
    fused = "sgd" in triton_kernels(t.triton_kernels) or cfg.optim.opt == "lars"
    if t.strategy == "ddp" and world_size == 1:
        t.strategy = "none"  # one process: DDP would only add a wrapper
    if world_size > 1 and t.strategy != "ddp":
        raise UserError(
            f"--strategy {t.strategy} with {world_size} processes: use --strategy ddp (each "
            "process would otherwise train its own copy)"
        )
    if fused and t.strategy in ("ddp", "dp"):
        raise UserError(
            f"--triton-kernels sgd / --opt lars keep gradients in one flat buffer, which "
            f"--strategy {t.strategy} replaces with its own; leave them out with several GPUs"
        )
    if t.strategy == "dp":
        if t.device != "cuda":
            raise UserError("--strategy dp needs CUDA GPUs; use --strategy none on the CPU")
        if t.cuda_graphs:
            raise UserError(
                "--strategy dp cannot run --cuda-graphs: DataParallel copies the model to every "
                "GPU from the host each step; use --strategy ddp with --nproc-per-node instead"
            )
        if t.compile:
            raise UserError(
                "--strategy dp cannot run --compile (DataParallel replicates the module every "
                "step, outside the compiled graph); use --strategy ddp with --nproc-per-node"
            )
        if gpus < 2:
            raise UserError(f"--strategy dp: {gpus} GPU visible; it needs at least 2")
    default, flag = TrainConfig(), {o.key: o.flag for o in OPTIONS}
    unused = [flag[f"train.{k}"] for k in DDP_ONLY if getattr(t, k) != getattr(default, k)]
    if t.strategy != "ddp" and unused and notes is not None:
        notes.append(
            f"{', '.join(unused)}: {'DDP settings' if len(unused) > 1 else 'a DDP setting'}, "
            f"unused with --strategy {t.strategy} "
            f"({world_size} process{'es' if world_size > 1 else ''})"
        )
    return cfg


def inductor_options(text: str | None) -> dict[str, Any]:
    """Parse ``NAME[=VALUE],...`` against torch._inductor.config; a bare NAME means True."""
    if text in (None, "", "none"):
        return {}
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    items: list[str] = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        # a string setting's value may hold commas itself (max_autotune_gemm_backends=ATEN,TRITON)
        if items and "=" not in item and item not in known and "=" in items[-1]:
            items[-1] += "," + item
        else:
            items.append(item)
    options: dict[str, Any] = {}
    for item in items:
        name, _, raw = item.partition("=")
        name = name.strip()
        if name not in known:
            raise UserError(
                f"--inductor-options: {name!r} is not a torch._inductor.config setting "
                "(e.g. conv_1x1_as_mm, coordinate_descent_tuning, max_autotune)"
            )
        if not raw:
            options[name] = True
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        default = known[name]
        if default is not None and not isinstance(value, type(default)):
            raise UserError(
                f"--inductor-options: {name}={raw} should be a {type(default).__name__} "
                f"like its default {default!r}"
            )
        options[name] = value
    return options


def save_resolved(cfg: Config, path: Path) -> None:
    """Write the resolved config; ``--config`` of this file reproduces the run."""
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
