"""``--batch-size auto``: the largest per-GPU batch that fits, found by running real steps.

Each trial builds the run's model and step (the same architecture, image size, AMP, channels-last
and CUDA-graph setting) on synthetic data, runs the step's warm-up and capture, and reads the
allocator's peak. A batch *fits* when nothing ran out of memory, the graph captured (if asked
for), and the peak stays within the memory free at the start less ``HEADROOM`` of the GPU's
total: the headroom is for what the trial does not hold, such as DALI's decoder buffers and the
compiled step's own workspace; memory other processes hold is never counted as free. The
search doubles from ``START`` until a batch does not fit, then bisects between the last fitting
and the first failing size, so the answer is a measured one, never a formula.

Under ``--progressive-resizing`` each train size is searched, the largest first; a smaller size
whose search finds a larger batch trains at it (``--batch-sizes``), in fewer, larger steps.

Trials use the uncompiled step: inductor's fused step holds less activation memory than eager
(10.6 against 11.0 GiB at batch 256 on an H200), and a compile per tried size would take minutes.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fasttrain.config import Config
from fasttrain.config.resolution import format_batch_sizes, parse_batch_sizes
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.run.runtime import seed_everything
from fasttrain.step.plan import Plan

log = logging.getLogger("fasttrain")

HEADROOM = 0.10  # of the GPU's memory, left free
START = 64
MULTIPLE = 8  # tensor-core friendly sizes
LIMIT = 16384


@dataclass(frozen=True)
class Found:
    batch: int
    peak_bytes: int  # the chosen batch's measured peak
    budget_bytes: int  # what a batch may use: the free memory less HEADROOM x the GPU's total
    trials: list[tuple[int, int | None]]  # (batch, peak bytes or None: out of memory / failed)
    seconds: float


def search(fits: Callable[[int], bool], start: int = START, limit: int = LIMIT) -> int:
    """The largest multiple of ``MULTIPLE`` up to ``limit`` for which ``fits`` holds (fitting
    assumed monotone in the batch), to within about 6%; 0 if not even ``MULTIPLE`` fits."""
    b = min(start, limit)
    if fits(b):
        good, bad = b, None
        while good * 2 <= limit:
            if not fits(good * 2):
                bad = good * 2
                break
            good *= 2
        if bad is None:
            return good  # everything up to the limit fits
    else:
        good, bad = 0, b
        while bad > MULTIPLE:
            b = max(MULTIPLE, bad // 2 // MULTIPLE * MULTIPLE)
            if fits(b):
                good = b
                break
            bad = b
        if not good:
            return 0
    resolution = max(MULTIPLE, good // 16 // MULTIPLE * MULTIPLE)
    while bad - good > resolution:
        mid = (good + bad) // 2 // MULTIPLE * MULTIPLE
        if not good < mid < bad:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def find_batch_size(
    build: Callable[[int], tuple[Callable[[], None], object]],
    device: torch.device,
    limit: int = LIMIT,
    start: int = START,
) -> Found:
    """Search with real steps on ``device``. ``build(batch)`` returns (run: the warm-up and
    capture of that batch's step, step: kept alive until the peak is read, and asked whether its
    graph capture failed). A batch may use the memory free now less ``HEADROOM`` of the GPU's
    total, so memory other processes (or DALI) already hold is left alone."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(free - HEADROOM * total)
    trials: list[tuple[int, int | None]] = []
    t0 = time.perf_counter()

    def trial(batch: int) -> int | None:
        # memory is already released: before the first trial above, after each in ``finally``
        torch.cuda.reset_peak_memory_stats(device)
        held = torch.cuda.memory_reserved(device)  # already held by this process: not the trial's
        peak: int | None
        log.disabled = True  # a failed capture's warning belongs to a trial, not to the run
        try:
            run, step = build(batch)
            run()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_reserved(device) - held
            if step.capture_failed:  # the capture failed (often: out of memory)
                peak = None
        except torch.cuda.OutOfMemoryError:
            peak = None
        finally:
            log.disabled = False
            run = step = None
            gc.collect()
            torch.cuda.empty_cache()
        trials.append((batch, peak))
        log.debug("--batch-size auto: batch %d: peak %s", batch, peak)
        return peak

    def fits(batch: int) -> bool:
        peak = trial(batch)
        return peak is not None and peak <= budget

    batch = search(fits, start=start, limit=limit) if budget > 0 else 0
    peaks = dict(trials)
    return Found(batch, peaks.get(batch) or 0, budget, trials, time.perf_counter() - t0)


def step_builder(
    make_training: Callable[[], Any],
    image_size: int,
    num_classes: int,
    dtype: torch.dtype,
    channels_last: bool,
    device: torch.device,
    steps: int,
) -> Callable[[int], tuple[Callable[[], None], object]]:
    """``build`` for ``find_batch_size``: fresh training parts per trial (``make_training``
    returns ``builder.Training``), fed one synthetic batch for ``steps`` steps (enough for the
    step's warm-up and capture, then a replay)."""
    from fasttrain.metrics.meter import DeviceMeter

    def build(batch: int):
        step = make_training().step
        x = torch.randn(batch, 3, image_size, image_size, device=device).to(dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, num_classes, (batch,), device=device)
        meter = DeviceMeter(device)

        def run() -> None:
            for i in range(steps):
                step([(x, y)], meter, i)

        return run, step

    return build


def fill_auto_batch_size(
    cfg: Config, dist: DistState, resumed: tuple[str, dict[str, Any]] | None
) -> None:
    """``--batch-size auto`` measured (``auto_batch_size``) and written into ``cfg``: the batch,
    each size's own batch and the parsed copy; the RNG seeded again, since the trials drew from
    it and the run starts as if they had not."""
    t = cfg.train
    t.batch_size, batches = auto_batch_size(cfg, dist, resumed)
    t.batch_sizes = format_batch_sizes(batches)
    cfg.parsed = dataclasses.replace(cfg.typed, batch_sizes=batches)
    seed_everything(t.seed)


def auto_batch_size(
    cfg: Config, dist: DistState, resumed: tuple[str, dict[str, Any]] | None
) -> tuple[int, dict[int, int]]:
    """``--batch-size auto``: the largest batch that fits the largest train size, measured by
    the trials above (the smallest over ranks), and under ``--progressive-resizing`` each
    smaller size's own largest batch, where larger (an epoch at a small size then takes fewer,
    larger steps; the LR follows each epoch's global batch, ``optim.plan_schedule``). Returns
    (the batch, {size: batch} of the sizes with their own). A resume takes the checkpoint's
    (an exact resume needs them)."""
    from fasttrain.run.build import build_training

    if resumed:
        saved = resumed[1]["config"]["train"]
        batch = int(saved["batch_size"])
        by_size = parse_batch_sizes(saved.get("batch_sizes"))
        log.info(
            "--batch-size auto: %d per GPU%s, as %s trained",
            batch,
            "".join(f", {b} at {s} px" for s, b in sorted(by_size.items())),
            resumed[0],
        )
        return batch, by_size
    classes = cfg.model.num_classes or 1000

    def make_training():
        # unwrapped: a trial runs no collective; uncompiled: see the module notes
        return build_training(
            cfg,
            dist,
            num_classes=classes,
            plan=Plan.uniform(100, 256, cfg.train.epochs),  # the LR does not change the memory
            parallel=False,
            compile=False,
        )

    if dist.is_main:
        log.info("--batch-size auto: trying batch sizes with real steps ...")
    resolution = cfg.typed.resolution
    sizes = resolution.sizes(cfg.train.epochs)[::-1]
    found: dict[int, int] = {}
    for size in sizes:  # the largest first: what fits it is where the others' search starts
        start = max(found.values(), default=START)
        found[size] = _largest_batch(cfg, dist, make_training, size, classes, start)
    batch = found[sizes[0]]
    return batch, {s: b for s, b in found.items() if b > batch}


def _largest_batch(
    cfg: Config,
    dist: DistState,
    make_training: Callable[[], Any],
    size: int,
    classes: int,
    start: int,
) -> int:
    """The largest batch at ``size`` px that fits on every rank (the smallest of their finds),
    from trials that start at ``start``."""
    from fasttrain.run.build import amp_dtype

    build = step_builder(
        make_training,
        size,
        classes,
        amp_dtype(cfg) or torch.float32,
        cfg.model.channels_last,
        dist.device,
        steps=5,  # the graph's 3 warm-up steps, its capture, one replay
    )
    found = find_batch_size(build, dist.device, start=start)
    batch = min(dist.all_gather_object(found.batch, "the auto batch sizes"))
    if batch == 0:
        raise UserError(
            f"--batch-size auto: not even a batch of 8 fits on {dist.device} ({cfg.model.arch} "
            f"at {size} px) with {HEADROOM:.0%} of its memory free; lower "
            "--image-size or choose a smaller --arch"
        )
    if dist.is_main:
        log.info(
            "--batch-size auto: %d per GPU at %d px (peak %.1f GiB, within the %.1f GiB "
            "allowed: the free memory less %.0f%% of the GPU); %d trials in %.0f s: %s",
            batch,
            size,
            found.peak_bytes / 2**30,
            found.budget_bytes / 2**30,
            HEADROOM * 100,
            len(found.trials),
            found.seconds,
            ", ".join(
                f"{b}: {'no' if p is None else f'{p / 2**30:.1f} GiB'}" for b, p in found.trials
            ),
        )
    return batch
