"""Timing and step builders shared by the GPU benchmarks in bench/ (scripts and suites)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fasttrain.config import OptimConfig, inductor_options, triton_kernels
from fasttrain.data.synthetic import SyntheticLoader
from fasttrain.metrics import DeviceMeter
from fasttrain.model import build_model
from fasttrain.optim import build_optimizer, build_schedule
from fasttrain.step import build_loss, build_step, compile_kwargs


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


def block_ms(fn: Callable[[], None], warmup: int, block: int, blocks: int) -> list[float]:
    """Each of ``blocks`` blocks' mean ms per call over ``block`` calls between two CUDA events,
    after ``warmup`` calls.

    Blocks, not single calls: a sync after every call would stop the host from running ahead,
    which the trainer never does, and would expose launch latency the trainer hides.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(blocks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(block):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / block)
    return out


def timed(
    step_fn: Callable[[], None], images: int, warmup: int = 30, block: int = 25, blocks: int = 6
) -> tuple[float, list[float]]:
    """img/s from the median of ``block_ms``'s blocks of steps of ``images``; every block's too."""
    rates = [images / (ms / 1e3) for ms in block_ms(step_fn, warmup, block, blocks)]
    return statistics.median(rates), rates


def make_step(
    kind: str,
    batch: int,
    *,
    arch: str = "resnet50",
    image_size: int = 224,
    mode: str = "default",
    options: str | None = None,
    kernels: str = "none",
) -> tuple[Callable[[], None], Any, DeviceMeter]:
    """One TrainStep variant ('eager', 'compiled', 'eager+graph', 'compiled+graph') on synthetic
    bf16 channels_last data, with the ``--triton-kernels`` named: a no-argument call that trains
    one step, the step, and its meter."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    use = triton_kernels(kernels)
    model = build_model(arch, 1000, True, dev, triton_maxpool="maxpool" in use)
    optim_cfg = OptimConfig(warmup_epochs=1, lr_schedule="cosine", label_smoothing=0.1)
    schedule = build_schedule(optim_cfg, batch, 5000, 90)
    optimizer = build_optimizer(model, optim_cfg, schedule.lr_at(0), triton="sgd" in use)
    criterion, _ = build_loss(0.1, "bf16", xent="xent" in use)
    step = build_step(
        model=model,
        optimizer=optimizer,
        criterion=criterion,
        amp_dtype=torch.bfloat16,
        scaler=None,
        schedule=schedule,
        compile="compiled" in kind,
        compile_options=compile_kwargs(mode, inductor_options(options)),
        cuda_graphs="graph" in kind,
        fixed_inputs=True,  # as the trainer does for the synthetic loader
    )
    data = SyntheticLoader(
        batch_size=batch,
        image_size=image_size,
        num_classes=1000,
        steps=1,
        device=dev,
        dtype=torch.bfloat16,
        channels_last=True,
        seed=0,
    )
    batch_pair = (data.images, data.labels)
    meter = DeviceMeter(dev)
    counter = iter(range(10**9))

    def one() -> None:
        step([batch_pair], meter, next(counter))

    return one, step, meter


def measure_step(kind: str, batch: int, **kw: Any) -> dict[str, Any]:
    """``make_step``'s variant timed by ``timed``: img/s, peak memory, first step and capture."""
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    one, step, meter = make_step(kind, batch, **kw)
    t0 = time.perf_counter()
    one()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    rate, rates = timed(one, batch)
    loss, _, _ = meter.flush()
    return {
        "kind": kind,
        "batch": batch,
        "mode": kw.get("mode", "default"),
        "options": kw.get("options") or "",
        "kernels": kw.get("kernels", "none"),
        "img_per_s": rate,
        "block_img_per_s": rates,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
        "first_step_s": first_s,
        "capture_s": getattr(step, "capture_s", None),
        "graph_failed": getattr(step, "failed", None),
        "loss": loss,
    }
