"""Fill every ``auto`` value and check the settings against each other, in one pass, once the
processes are up (``DistState`` knows the device, the world size and the nodes).

After ``resolve`` the config says exactly what runs, and that is what the run directory's
``config.yaml`` records: ``--config`` of that file reproduces the run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fasttrain.config import KERNELS, Config, TrainConfig
from fasttrain.config.parse import Parsed, inductor_options, triton_kernels
from fasttrain.config.paths import found_exclude_list
from fasttrain.config.resolution import resolve_sizes
from fasttrain.errors import UserError
from fasttrain.model.fused_support import check
from fasttrain.run.moot import Launch, given_keys, moot_notes
from fasttrain.run.resolve_bn import SupportCheck, resolve_bn_paths
from fasttrain.step.late_tuning import tunes_kernels

if TYPE_CHECKING:
    from fasttrain.dist.state import DistState

# What --compile-mode auto compiles with on a GPU: inductor's default mode plus coordinate-descent
# tuning of its Triton kernels, the fastest measured with --cuda-graphs (docs/DESIGN.md).
FASTEST_COMPILE_MODE = "default"
FASTEST_INDUCTOR_OPTIONS = "coordinate_descent_tuning"


def resolve(
    cfg: Config,
    dist: DistState,
    *,
    gpus: int | None = None,
    cpus: int | None = None,
    dali: bool | None = None,
    notes: list[str] | None = None,
    fused_support: SupportCheck = check,
) -> Config:
    """Fill the auto values for this launch, in place, and refuse combinations that cannot
    work; the strings that hold several values are parsed as they are checked, once, into
    ``cfg.parsed``. ``gpus``, ``cpus`` and ``dali`` (visible GPUs, usable CPU cores, whether DALI
    imports) are looked up when not given, and ``fused_support`` answers what cuDNN runs of the
    fused model here. What the user should hear once goes into ``notes``. The run folder is
    ``runs.place_run``'s to choose, after this."""
    notes = [] if notes is None else notes
    given = given_keys(cfg)  # before any auto value is filled in
    t, d = cfg.train, cfg.data
    t.device = dist.device.type
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if t.device == "cuda" else 0
    if cfg.model.weights is not None and not Path(cfg.model.weights).expanduser().is_file():
        raise UserError(f"--weights {cfg.model.weights}: no such file")
    if t.amp == "fp16" and t.device == "cpu":
        raise UserError("--amp fp16 needs a CUDA GPU; use --amp bf16 or off on the CPU")
    if cfg.run.test_only:
        _resolve_test_only(cfg)
    if t.batch_size is None and t.device != "cuda":
        raise UserError(
            "--batch-size auto measures GPU memory by running the step; on the CPU give a "
            "number (e.g. --batch-size 32)"
        )
    if d.workers is None:
        d.workers = min(16, cpus or len(os.sched_getaffinity(0)))
    inductor = _resolve_compile(t, notes, sample=d.path is None and d.loader != "synthetic")
    if d.loader == "auto":
        if dali is None:
            from fasttrain.data.dali_install import dali_available

            dali = dali_available()
        d.loader = "dali" if t.device == "cuda" and dali else "torchvision"
        if t.device == "cuda" and not dali:
            from fasttrain.data.dali_install import INSTALL_DALI

            notes.append(
                "DALI is not installed, so the torchvision loader decodes on the CPU; "
                f"{INSTALL_DALI} decodes on the GPU"
            )
    if d.loader == "dali" and t.device == "cuda":
        import torch

        from fasttrain.data.dali_install import dali_cuda_mismatch

        mismatch = dali_cuda_mismatch(torch.version.cuda)
        if mismatch:
            notes.append(mismatch)
    if d.path is not None:
        d.path = str(Path(d.path).expanduser())
        found = found_exclude_list(d.path)
        if d.exclude_list is None and found is not None:
            d.exclude_list = str(found)
    resolution, batch_sizes = resolve_sizes(cfg, notes)
    seen = {*resolution.sizes(t.epochs), d.val_crop_size or d.image_size}  # train and val
    bn_path = resolve_bn_paths(cfg, notes, sorted(seen), fused_support)
    if d.auto_augment != "none" and d.loader == "synthetic":
        raise UserError(
            f"--auto-augment {d.auto_augment}: --loader synthetic has no images to augment; "
            "leave one out"
        )
    _lr_notes(cfg, notes)
    _resolve_parallel(cfg, dist, gpus)
    kernels = _resolve_kernels(cfg)  # after the loader and the strategy, which decide auto
    cfg.parsed = Parsed(kernels, inductor, resolution, batch_sizes, bn_path)
    if t.tune_kernels == "auto":  # several processes would each switch at a step of their own
        t.tune_kernels = "later" if dist.world_size == 1 else "first-step"
    elif t.tune_kernels == "later" and dist.world_size > 1 and tunes_kernels(cfg):
        raise UserError(
            f"--tune-kernels later: one process only ({dist.world_size} here, each of which "
            "would tune at a step of its own); leave it out, so that the job tunes at its first "
            "step, or fill the cache first with python -m fasttrain compile and the job's flags"
        )
    notes += moot_notes(cfg, given, Launch(dist.world_size))  # now that every mode is known
    return cfg


def _resolve_compile(t: TrainConfig, notes: list[str], sample: bool) -> dict[str, Any]:
    """Check the compile and graph settings together; fill the mode and inductor options, and
    return those parsed (none without --compile)."""
    given = t.inductor_options
    if not t.compile:
        if t.compile_mode not in ("auto", "default"):
            raise UserError(f"--compile-mode {t.compile_mode}: add --compile to use it")
        if given not in (None, "", "none"):
            raise UserError(f"--inductor-options {given}: add --compile to use it")
        t.compile_mode, t.inductor_options, inductor = "default", None, {}
    else:
        inductor = inductor_options(given)  # a bad name or value fails now, not mid-compile
        if t.compile_mode == "auto":
            fast = t.device == "cuda" and not sample
            t.compile_mode = FASTEST_COMPILE_MODE if fast else "default"
            # the tuning joins --inductor-options, unless they set it themselves or say none
            tuning = FASTEST_INDUCTOR_OPTIONS
            if fast and given not in ("", "none") and tuning not in inductor:
                inductor = {tuning: True, **inductor}
                t.inductor_options = ",".join(filter(None, (tuning, given)))
        if t.inductor_options is None:
            t.inductor_options = "none"
    if t.cuda_graphs and t.device != "cuda":
        t.cuda_graphs = False
        notes.append("--cuda-graphs needs a CUDA GPU: training without CUDA graphs")
    if t.cuda_graphs and t.compile and t.compile_mode in ("reduce-overhead", "max-autotune"):
        raise UserError(
            f"--compile-mode {t.compile_mode} captures CUDA graphs of its own, which cannot nest "
            "in --cuda-graphs' whole-step graph: use --compile-mode max-autotune-no-cudagraphs "
            "or default with --cuda-graphs"
        )
    return inductor


def _lr_notes(cfg: Config, notes: list[str]) -> None:
    """A step schedule whose first decay falls past the run's last epoch never lowers the LR:
    the run ends at its peak, wherever the noise leaves it. Said once, with what to use."""
    o, epochs = cfg.optim, cfg.train.epochs
    if o.lr_schedule == "step" and epochs <= o.lr_step_epochs and not cfg.run.test_only:
        notes.append(
            f"the LR never decays in this run: --lr-schedule step multiplies it by --lr-gamma "
            f"every {o.lr_step_epochs} epochs (--lr-step-epochs), and the run has {epochs}; use "
            "--lr-schedule cosine, or a smaller --lr-step-epochs"
        )


def _resolve_test_only(cfg: Config) -> None:
    """--test-only (``evaluate``) needs weights, and has no training step to size a batch by."""
    if cfg.model.weights is None:
        raise UserError(
            "--test-only evaluates the model in --weights FILE: give one (a checkpoint, an "
            "export, or a torchvision or timm state dict)"
        )
    if cfg.run.resume is not None:
        raise UserError(
            "--test-only evaluates --weights; --resume continues training: give the checkpoint "
            "as --weights"
        )
    if cfg.train.batch_size is None:
        cfg.train.batch_size = 256 if cfg.train.device == "cuda" else 32


def _resolve_parallel(cfg: Config, dist: DistState, gpus: int) -> None:
    """The strategy from the launch, and DDP's bucket size (the compiled step's graphs are split
    at its buckets, so the compile cache's key holds the number)."""
    t, world_size = cfg.train, dist.world_size
    if t.strategy == "auto" or (t.strategy == "ddp" and world_size == 1):
        t.strategy = "ddp" if world_size > 1 else "none"  # one process: DDP only adds a wrapper
    if world_size > 1 and t.strategy != "ddp":
        raise UserError(
            f"--strategy {t.strategy} with {world_size} processes: use --strategy ddp (each "
            "process would otherwise train its own copy)"
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
    if t.strategy == "ddp":
        from fasttrain.dist.parallel import ddp_bucket_cap_mb

        t.bucket_cap_mb = ddp_bucket_cap_mb(t, dist)


def _resolve_kernels(cfg: Config) -> frozenset[str]:
    """``auto`` picks the kernels measured faster in the step; named ones are checked. Returns
    the set."""
    t = cfg.train
    gpu = t.device == "cuda"
    if t.triton_kernels == "auto":
        picked = {
            "normalize": gpu and cfg.data.loader == "torchvision",
            "maxpool": gpu and cfg.model.channels_last,  # its tiles read channels contiguously
            # not sgd, for LARS either: torch's foreach LARS made the graphed ResNet-50 step
            # 1.6% faster than the Triton kernel on an H200 (BENCHMARKS.md, recipe pieces)
        }
        kernels = frozenset(k for k, on in picked.items() if on)
    else:
        kernels = triton_kernels(t.triton_kernels)
        if kernels and not gpu:
            raise UserError(
                "--triton-kernels runs Triton kernels, which need a CUDA GPU; leave it out here"
            )
        if "normalize" in kernels and cfg.data.loader != "torchvision":
            raise UserError(
                f"--triton-kernels normalize is the torchvision loader's; --loader "
                f"{cfg.data.loader} does not use it"
            )
    if "xent" in kernels and (t.mixup_alpha > 0 or t.cutmix_alpha > 0):
        raise UserError(
            "--triton-kernels xent takes class labels, and mixup/CutMix trains on mixed soft "
            "targets: leave xent out with --mixup-alpha / --cutmix-alpha"
        )
    if "sgd" in kernels and t.strategy in ("ddp", "dp"):
        raise UserError(
            f"--triton-kernels sgd keeps gradients in one flat buffer, which --strategy "
            f"{t.strategy} replaces with its own; leave it out with several GPUs (--opt lars "
            "then runs in torch's foreach ops)"
        )
    t.triton_kernels = ",".join(k for k in KERNELS if k in kernels) or "none"
    return kernels
