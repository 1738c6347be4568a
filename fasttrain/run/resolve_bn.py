"""Checks and settings of the two cuDNN BatchNorm paths, ``--fused-bn`` (BN folded into the
convolutions, fp16) and ``--cudnn-bn`` (cuDNN's standalone BN kernels), for ``resolve``."""

from __future__ import annotations

from fasttrain.config import Config
from fasttrain.errors import UserError


def resolve_bn_paths(cfg: Config, notes: list[str]) -> None:
    """Refuse what a chosen BN path cannot run with, and set what it needs (fp16 for
    --fused-bn); on the CPU, a note that the reference runs."""
    if cfg.model.fused_bn:
        _resolve_fused_bn(cfg, notes)
    if cfg.model.cudnn_bn:
        _resolve_cudnn_bn(cfg, notes)


def _resolve_fused_bn(cfg: Config, notes: list[str]) -> None:
    """--fused-bn's settings: cuDNN fuses BN into convolutions in fp16 and NHWC only, and the
    fused forward computes each BN from its own process's batch (as plain BN does)."""
    t = cfg.train
    if not _cudnn_bn_path(
        cfg,
        notes,
        "--fused-bn",
        "sums each BatchNorm's statistics with atomic adds inside cuDNN's fused convolution, in "
        "no fixed order",
        "computes each BatchNorm's statistics inside the convolutions, per process",
        "runs the fused decomposition",
    ):
        return
    if t.amp is None:
        t.amp = "fp16"
    elif t.amp != "fp16":
        raise UserError(
            f"--fused-bn trains in fp16 (cuDNN fuses BatchNorm into convolutions only in fp16): "
            f"use --amp fp16 or leave --amp out, not --amp {t.amp}"
        )
    _needs_nhwc_and_frontend(cfg, "--fused-bn", "cuDNN's fused convolutions")


def _resolve_cudnn_bn(cfg: Config, notes: list[str]) -> None:
    """--cudnn-bn's settings: cuDNN's BN kernels take bf16 or fp16 NHWC tensors, and compute
    each BN from its own process's batch."""
    if cfg.model.fused_bn:
        raise UserError(
            "--cudnn-bn and --fused-bn are two ways to run BatchNorm: choose one of them"
        )
    if not _cudnn_bn_path(
        cfg,
        notes,
        "--cudnn-bn",
        "runs cuDNN's BatchNorm kernels, which promise no fixed order of their reductions",
        "computes each BatchNorm's statistics per process",
        "runs its BatchNorm op",
    ):
        return
    if cfg.train.amp == "off":
        raise UserError(
            "--cudnn-bn runs cuDNN's BatchNorm kernels in bf16 or fp16: use --amp bf16 or fp16 "
            "(or leave --amp out), not --amp off"
        )
    _needs_nhwc_and_frontend(cfg, "--cudnn-bn", "cuDNN's BatchNorm kernels")


def _cudnn_bn_path(
    cfg: Config, notes: list[str], flag: str, unordered: str, per_process: str, reference: str
) -> bool:
    """What both cuDNN BatchNorm paths refuse (--deterministic on a GPU, --sync-bn), and on the
    CPU a note that the reference runs. True on a GPU, where the path's own checks follow."""
    t = cfg.train
    if t.deterministic and t.device == "cuda":
        raise UserError(f"{flag} {unordered}: leave out --deterministic or {flag}")
    if t.sync_bn:
        raise UserError(
            f"{flag} {per_process}; it cannot synchronise them: leave out --sync-bn or {flag}"
        )
    if t.device != "cuda":
        notes.append(f"{flag} on the CPU {reference} in plain PyTorch (a reference: correct, "
                     "not faster)")  # fmt: skip
        return False
    return True


def _needs_nhwc_and_frontend(cfg: Config, flag: str, kernels: str) -> None:
    if not cfg.model.channels_last:
        raise UserError(f"{flag} runs {kernels}, which take NHWC tensors: leave out "
                        "--no-channels-last")  # fmt: skip
    from fasttrain.model.cudnn import graph as cudnn_graph

    if not cudnn_graph.available():
        raise UserError(
            f"{flag} needs the cuDNN frontend on a GPU: pip install --no-deps "
            "nvidia-cudnn-frontend (its declared dependencies serve other features)"
        )
