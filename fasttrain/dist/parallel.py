"""Data parallelism: wrap the model for ``--strategy`` (DDP, DataParallel or none), and keep
per-rank BatchNorm statistics in agreement.

The step trains the wrapped model; checkpoints and evaluation use the raw module, so saved keys
never carry a ``module.`` prefix and evaluation runs no collective of DDP's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from fasttrain.config import TrainConfig
from fasttrain.dist.state import DistState

# --ddp-comm-hook: PyTorch's own hooks, each bucket cast to 16 bits for the all-reduce
COMM_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}


@dataclass(frozen=True)
class Wrapped:
    """The module the training step calls, and the side stream DDP was built on, if any: under
    --cuda-graphs DDP's reducer binds to the stream it is built on, so the graphed step must warm
    up and capture on that same stream (PyTorch CUDA notes)."""

    net: nn.Module
    side_stream: torch.cuda.Stream | None = None


def wrap_model(model: nn.Module, t: TrainConfig, dist: DistState) -> Wrapped:
    """``model`` itself, or DDP / DataParallel around it, as ``--strategy`` says."""
    if t.strategy == "dp":
        return Wrapped(nn.DataParallel(model))
    if t.strategy != "ddp":
        return Wrapped(model)
    if t.sync_bn:
        # converts in place module by module; the raw model's BN layers become SyncBatchNorm
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    gpu = dist.device.type == "cuda"
    side = torch.cuda.Stream(dist.device) if gpu and t.cuda_graphs else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dist.device))
    with torch.cuda.stream(side) if side is not None else nullcontext():
        ddp = DistributedDataParallel(
            model,
            device_ids=[dist.device.index] if gpu else None,
            bucket_cap_mb=ddp_bucket_cap_mb(t, dist),
            gradient_as_bucket_view=True,
            broadcast_buffers=t.broadcast_buffers,
        )
    if t.ddp_comm_hook != "none":
        # state None: the default process group, the one DDP reduces over
        ddp.register_comm_hook(None, COMM_HOOKS[t.ddp_comm_hook])
    if side is not None:
        torch.cuda.current_stream(dist.device).wait_stream(side)
    return Wrapped(ddp, side)


def ddp_bucket_cap_mb(t: TrainConfig, dist: DistState) -> int:
    """``--bucket-cap-mb``, or for auto: 100 MB on one node, where fewer, larger all-reduces
    ran faster inside the graph (BENCHMARKS.md); PyTorch's 25 MB across nodes, where
    overlapping more of the all-reduce with the backward matters more (not measured)."""
    if t.bucket_cap_mb is not None:
        return t.bucket_cap_mb
    return 100 if dist.one_node else 25


def ddp_description(t: TrainConfig, dist: DistState) -> str:
    """How DDP reduces, for the run's log: bucket size and any compression hook."""
    hook = f", {t.ddp_comm_hook} all-reduce" if t.ddp_comm_hook != "none" else ""
    return f"ddp ({ddp_bucket_cap_mb(t, dist)} MB buckets{hook})"


def average_bn_statistics(model: nn.Module, dist: DistState) -> None:
    """Average BatchNorm running statistics over ranks, in place (the CUDA graph reads them at
    fixed addresses). Without ``--broadcast-buffers`` each rank's drift apart; evaluation and
    checkpoints should see the same model on every rank."""
    if not dist.distributed:
        return
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
            what = "the all_reduce of BatchNorm statistics"
            dist.all_reduce_(module.running_mean, "mean", what)
            dist.all_reduce_(module.running_var, "mean", what)
