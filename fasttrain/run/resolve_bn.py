"""Which BatchNorm path a run takes, and the precision that goes with it, for ``resolve``:
BatchNorm folded into the convolutions (``--fused-bn``, fp16), cuDNN's standalone BN kernels
(``--cudnn-bn``), or the plain one that ``torch.compile`` generates.

``--fused-bn auto`` (the default) takes the fused path on a CUDA GPU where cuDNN runs every
convolution of the model at the run's shapes (``fused_support.check``), in fp16, and otherwise
the plain path, with the reason in one line; ``on`` insists, ``off`` declines. ``--amp auto``
follows the path: fp16 on the fused one, bf16 on the plain one on a GPU, off on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from fasttrain.config import Config
from fasttrain.errors import UserError
from fasttrain.model.fused_support import FusedSupport, check

# (arch, batch, image sizes, device) -> what cuDNN runs of the fused model there
SupportCheck = Callable[[str, int, Iterable[int], torch.device], FusedSupport]
# what --batch-size auto's search starts the shapes from, before it has measured a batch
PROBE_BATCH = 256


def resolve_bn_paths(
    cfg: Config, notes: list[str], sizes: Iterable[int], support: SupportCheck = check
) -> str:
    """Settle ``--fused-bn`` to on or off and ``--amp`` to a precision, refusing what a chosen
    path cannot run with; returns the BatchNorm path in words, for the start-up line.
    ``sizes``: the image sizes the model sees (train and val); ``support``: what cuDNN runs of
    the fused model here (asked only where the answer matters)."""
    m, t = cfg.model, cfg.train
    if m.cudnn_bn:
        if m.fused_bn == "on":
            raise UserError("--cudnn-bn and --fused-bn are two ways to run BatchNorm: choose one")
        m.fused_bn = "off"
        _resolve_cudnn_bn(cfg, notes)
        path = "cuDNN's BatchNorm kernels (--cudnn-bn)"
    elif m.fused_bn == "auto":
        reason = _why_not_fused(cfg, sizes, support)
        m.fused_bn = "off" if reason else "on"
        path = (
            f"plain (--fused-bn auto: {reason})"
            if reason
            else "folded into the convolutions (--fused-bn auto)"
        )
    elif m.fused_bn == "on":
        _resolve_fused_on(cfg, notes, sizes, support)
        path = "folded into the convolutions (--fused-bn on)"
    else:
        path = "plain (--fused-bn off)"
    if t.amp == "auto":
        fp16 = m.fused_bn == "on" and t.device == "cuda"
        t.amp = "fp16" if fp16 else ("bf16" if t.device == "cuda" else "off")
    return path


def _why_not_fused(cfg: Config, sizes: Iterable[int], support: SupportCheck) -> str | None:
    """Why ``--fused-bn auto`` takes the plain path here, in a few words; None where the fused
    one runs."""
    t = cfg.train
    if t.device != "cuda":
        return "on the CPU"
    if t.amp in ("bf16", "off"):
        return f"--amp {t.amp} (cuDNN fuses BatchNorm into convolutions in fp16 only)"
    if not cfg.model.channels_last:
        return "--no-channels-last (cuDNN's fused convolutions take NHWC tensors)"
    if t.deterministic:
        return "--deterministic (the fused path sums statistics with atomic adds)"
    if t.sync_bn:
        return "--sync-bn (the fused path computes each BatchNorm per process)"
    found = support(cfg.model.arch, t.batch_size or PROBE_BATCH, sizes, torch.device("cuda"))
    return None if found.runs else found.why_not()


def _resolve_fused_on(
    cfg: Config, notes: list[str], sizes: Iterable[int], support: SupportCheck
) -> None:
    """--fused-bn on: cuDNN fuses BN into convolutions in fp16 and NHWC only, and the fused
    forward computes each BN from its own process's batch (as plain BN does); on a GPU every
    convolution must run fused."""
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
    if t.amp not in ("auto", "fp16"):
        raise UserError(
            f"--fused-bn trains in fp16 (cuDNN fuses BatchNorm into convolutions only in fp16): "
            f"use --amp fp16 or auto, not --amp {t.amp}"
        )
    _needs_nhwc(cfg, "--fused-bn", "cuDNN's fused convolutions")
    found = support(cfg.model.arch, t.batch_size or PROBE_BATCH, sizes, torch.device("cuda"))
    if not found.runs:
        raise UserError(
            f"--fused-bn on: {found.why_not()}; those layers would run the plain-PyTorch "
            "reference. Use --fused-bn auto (the plain path here) or off"
        )


def _resolve_cudnn_bn(cfg: Config, notes: list[str]) -> None:
    """--cudnn-bn's settings: cuDNN's BN kernels take bf16 or fp16 NHWC tensors, and compute
    each BN from its own process's batch."""
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
    _needs_nhwc(cfg, "--cudnn-bn", "cuDNN's BatchNorm kernels")
    from fasttrain.model.cudnn import graph as cudnn_graph

    if not cudnn_graph.available():
        raise UserError(
            "--cudnn-bn needs the cuDNN frontend on a GPU: pip install nvidia-cudnn-frontend "
            "(fasttrain's own install brings it on Linux)"
        )


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


def _needs_nhwc(cfg: Config, flag: str, kernels: str) -> None:
    if not cfg.model.channels_last:
        raise UserError(f"{flag} runs {kernels}, which take NHWC tensors: leave out "
                        "--no-channels-last")  # fmt: skip
