"""Settings the run does not read, named once at start instead of dropped without a word.

Each option is read in every mode (``ALWAYS_READ``) or is listed below for the modes in which
nothing reads it; a test walks the table, and fails for an option in neither, so a flag added
later cannot be forgotten. A setting is named only when the user gave it (on the command line or
in a recipe), away from its default: a default nothing reads says nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from fasttrain.config import OPTION_BY_KEY, Config
from fasttrain.run.compile_cache import why_no_trace
from fasttrain.step.late_tuning import tunes_kernels

# the DDP wrapper's settings: read only with --strategy ddp
DDP_ONLY = (
    "train.bucket_cap_mb",
    "train.broadcast_buffers",
    "train.sync_bn",
    "train.ddp_comm_hook",
)
DALI = ("data.dali_threads", "data.dali_prefetch", "data.dali_hw_decoder_load")
PROFILE = ("run.profile_wait", "run.profile_warmup", "run.profile_active", "run.profile_repeat")
MIXING = ("train.mixup_prob", "train.mixup_switch_prob")
EMA = ("train.model_ema_decay", "train.model_ema_steps", "train.model_ema_warmup")
# what only training reads: `evaluate` / --test-only loads weights and evaluates them
TRAINING = (
    *(key for key in OPTION_BY_KEY if key.startswith("optim.")),
    "train.epochs",
    "train.max_steps",
    "train.batch_sizes",
    "train.accum_steps",
    "train.on_nan",
    "train.tune_kernels",
    "train.random_erase",
    "train.mixup_alpha",
    "train.cutmix_alpha",
    *MIXING,
    *EMA,
    *DDP_ONLY,
    "data.auto_augment",
    "data.progressive_resizing",
    "model.zero_init_residual",
    "run.ckpt_every_steps",
    "run.keep_checkpoints",
    "run.eval_every",
    "run.log_every",
    "run.profile",
    *PROFILE,
)


@dataclass(frozen=True)
class Launch:
    """What the run is, beside its config: how many processes."""

    world_size: int


@dataclass(frozen=True)
class Moot:
    """``keys`` are read by nothing when ``applies``; the note says ``why``."""

    keys: tuple[str, ...]
    applies: Callable[[Config, Launch], bool]
    why: Callable[[Config, Launch], str]


def _processes(launch: Launch) -> str:
    return f"{launch.world_size} process{'es' if launch.world_size > 1 else ''}"


MOOT = (
    Moot(("optim.lr_step_epochs", "optim.lr_gamma"),
         lambda c, _: c.optim.lr_schedule != "step",
         lambda c, _: f"unused with --lr-schedule {c.optim.lr_schedule}"),
    Moot(("optim.lr_power",),
         lambda c, _: c.optim.lr_schedule != "poly",
         lambda c, _: f"unused with --lr-schedule {c.optim.lr_schedule}"),
    Moot(("optim.lars_eta",),
         lambda c, _: c.optim.opt != "lars",
         lambda c, _: f"unused with --opt {c.optim.opt}"),
    Moot(EMA, lambda c, _: not c.train.model_ema, lambda c, _: "unused without --model-ema"),
    Moot(("train.compile_cache", "train.trace_cache"),
         lambda c, _: not c.train.compile,
         lambda c, _: "unused without --compile"),
    Moot(("train.tune_kernels",),
         lambda c, _: not tunes_kernels(c),
         lambda c, _: "unused: no kernel is tuned (--compile with --compile-mode auto on a GPU, "
                      "or coordinate_descent_tuning in --inductor-options, tunes them)"),
    Moot(("train.trace_cache",),
         lambda c, launch: c.train.compile and why_no_trace(c, launch.world_size) is not None,
         lambda c, launch: f"unused: {why_no_trace(c, launch.world_size)}"),
    Moot(MIXING,
         lambda c, _: not (c.train.mixup_alpha > 0 or c.train.cutmix_alpha > 0),
         lambda c, _: "unused without --mixup-alpha or --cutmix-alpha"),
    Moot(DDP_ONLY,
         lambda c, _: c.train.strategy != "ddp",
         lambda c, launch: f"unused with --strategy {c.train.strategy} ({_processes(launch)}): "
                           "DDP's own"),
    Moot(("train.dist_timeout",),
         lambda c, launch: launch.world_size == 1,
         lambda c, launch: "unused in one process (it bounds the collectives between several)"),
    Moot(("data.path", "data.exclude_list", "data.workers", *DALI, "data.val_resize_size",
          "data.val_crop_size", "run.eval_every"),
         lambda c, _: c.data.loader == "synthetic",
         lambda c, _: "unused with --loader synthetic (fixed tensors on the device, no images, "
                      "no val set)"),
    Moot(("data.workers",),
         lambda c, _: c.data.loader == "dali",
         lambda c, _: "unused with --loader dali (DALI decodes with --dali-threads)"),
    Moot(DALI,
         lambda c, _: c.data.loader == "torchvision",
         lambda c, _: "unused with --loader torchvision"),
    Moot(("data.dali_hw_decoder_load",),
         lambda c, _: c.data.loader == "dali" and c.train.device != "cuda",
         lambda c, _: "unused in DALI's CPU mode (no GPU, no hardware decoder)"),
    Moot(("data.synthetic_steps",),
         lambda c, _: c.data.loader != "synthetic",
         lambda c, _: f"unused with --loader {c.data.loader} (an epoch is the data set)"),
    Moot(PROFILE, lambda c, _: not c.run.profile, lambda c, _: "unused without --profile"),
    Moot(TRAINING,
         lambda c, _: c.run.test_only,
         lambda c, _: "unused by evaluate (--test-only), which trains nothing"),
)  # fmt: skip

# read in every mode where they can be given (the rest are refused where they cannot be honoured)
ALWAYS_READ = frozenset(
    {
        "data.loader", "data.image_size", "model.arch", "model.num_classes", "model.channels_last",
        "model.weights", "model.fused_bn", "model.cudnn_bn", "train.batch_size", "train.amp",
        "train.compile", "train.compile_mode", "train.inductor_options", "train.cuda_graphs",
        "train.triton_kernels", "train.strategy", "train.device", "train.model_ema",
        "train.deterministic", "train.seed", "run.output_dir", "run.name", "run.test_only",
        "run.resume", "run.break_lock",
    }
)  # fmt: skip


def given_keys(cfg: Config) -> frozenset[str]:
    """The options ``cfg`` sets away from their defaults: what the user gave, before ``resolve``
    fills in the ``auto`` values."""
    default = Config()
    return frozenset(k for k in OPTION_BY_KEY if cfg.get(k) != default.get(k))


def moot_notes(cfg: Config, given: Collection[str], launch: Launch) -> list[str]:
    """One note per reason: the given settings that nothing reads in this run, by flag."""
    by_reason: dict[str, list[str]] = {}
    for moot in MOOT:
        if moot.applies(cfg, launch):
            flags = by_reason.setdefault(moot.why(cfg, launch), [])
            flags += [OPTION_BY_KEY[k].flag for k in moot.keys if k in given]
    return [f"{', '.join(dict.fromkeys(f))}: {why}" for why, f in by_reason.items() if f]
