"""Metrics: device-side accumulators, flushed every ``--log-every`` steps to the progress bar,
TensorBoard (``<run>/tb``) and ``metrics.jsonl``.

The flush is the one host sync of the steady state. Throughput is images over the wall time between
two flushes; both ends are synchronised, so the figure is what the GPU actually did.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fasttrain.distributed import DistState

log = logging.getLogger("fasttrain")


class DeviceMeter:
    """Sum of per-batch loss x batch size and of correct predictions, kept on the device."""

    def __init__(self, device: torch.device, dist: DistState | None = None):
        self.dist = dist
        self.sums = torch.zeros(3, device=device)  # loss x n, correct, non-finite losses
        self.nonfinite = 0  # non-finite losses in the last flushed interval, over all ranks
        self.samples = 0  # this rank's, known on the host: no need to count it on the device

    def add_device(self, loss: torch.Tensor, correct: torch.Tensor, n: int) -> None:
        """Accumulate in place on the device (a CUDA graph can record this); the caller adds
        the ``n`` samples to ``samples`` on the host, once per step actually run."""
        bad = (~torch.isfinite(loss)).float()
        self.sums += torch.stack((loss.float() * n, correct.float(), bad))

    def flush(self) -> tuple[float, float, int]:
        """(mean loss, top-1 %, samples) since the last flush, over all ranks: the one all-reduce
        and the one host sync of a log step."""
        world = 1
        if self.dist is not None:
            self.dist.all_reduce_(self.sums, what="the all_reduce of the metrics at a log step")
            world = self.dist.world_size
        loss_sum, correct, nonfinite = self.sums.tolist()
        self.nonfinite = int(nonfinite)
        n = self.samples * world
        self.sums.zero_()
        self.samples = 0
        return loss_sum / max(n, 1), 100.0 * correct / max(n, 1), n


def steady_rate(intervals: Sequence[tuple[int, float, float]]) -> float | None:
    """Steady-state img/s: images over time, summed over the intervals (epoch, images, seconds)
    after the first epoch.

    The first epoch is left out: it holds warm-up and compile, and a loader that prefetched
    during the compile makes it look faster than the loader is. A run shorter than two epochs
    leaves out only its first interval. Weighting by images, not a median of intervals, keeps a
    short interval at an epoch's end from counting as much as a full one.
    """
    if not intervals:
        return None
    first_epoch = intervals[0][0]
    kept = [iv for iv in intervals if iv[0] > first_epoch] or intervals[1:]
    seconds = sum(iv[2] for iv in kept)
    return sum(iv[1] for iv in kept) / seconds if seconds > 0 else None


class Metrics:
    """Owns the progress bar, TensorBoard writer and JSONL file (main process only)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int,
        world_size: int,
        device: torch.device,
    ):
        self.is_main = is_main
        self.world_size = world_size
        self.device = device
        self.intervals: list[tuple[int, int, float]] = []  # (epoch, images, seconds)
        self.writer = None
        self.jsonl = None
        self.bar = None
        if is_main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tb"))
            self.jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            # a live bar on a terminal; with no terminal (logs, CI) the log lines carry progress
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                disable=not sys.stderr.isatty(),
                file=sys.stderr,
            )
        self.restart_interval()

    def restart_interval(self) -> None:
        """Start a new timing interval (after compile, eval or a checkpoint: they are not steps)."""
        self.t0 = time.perf_counter()
        self.images = 0
        self.data_wait = 0.0
        self.steps = 0

    def step_done(self, images: int, data_wait: float) -> None:
        """Host-side bookkeeping only; no device access."""
        self.images += images
        self.data_wait += data_wait
        self.steps += 1
        if self.bar is not None:
            self.bar.update(1)

    def _emit(self, record: dict[str, Any], scalars: dict[str, float], step: int) -> None:
        if not self.is_main:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_train(
        self, step: int, epoch: int, meter: DeviceMeter, lr: float, timer=None
    ) -> dict[str, Any]:
        loss, top1, _ = meter.flush()  # syncs: the interval's work is now finished
        gpu_ms = timer.read_ms() if timer is not None else None  # its events are done too
        elapsed = time.perf_counter() - self.t0
        rate = self.images / elapsed if elapsed > 0 else 0.0
        self.intervals.append((epoch, self.images, elapsed))
        record = {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "nonfinite_losses": meter.nonfinite,
            "top1": top1,
            "lr": lr,
            "img_per_s": rate,
            "img_per_s_per_gpu": rate / self.world_size,
            "data_wait_frac": self.data_wait / elapsed if elapsed > 0 else 0.0,
            "data_wait_ms": 1e3 * self.data_wait / max(self.steps, 1),
            "gpu_step_ms": gpu_ms,
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        self._emit(
            record,
            {
                "train/loss": loss,
                "train/top1": top1,
                "train/lr": lr,
                "perf/img_per_s": rate,
                "perf/img_per_s_per_gpu": record["img_per_s_per_gpu"],
                "perf/data_wait_frac": record["data_wait_frac"],
                "perf/data_wait_ms": record["data_wait_ms"],
                **({"perf/gpu_step_ms": gpu_ms} if gpu_ms is not None else {}),
                "perf/peak_mem_gib": record["peak_mem_gib"],
            },
            step,
        )
        gpu = f" gpu {gpu_ms:.1f} ms/step" if gpu_ms is not None else ""
        line = (
            f"epoch {epoch} step {step}: loss {loss:.4f} top1 {top1:.1f}% lr {lr:.4g} "
            f"{rate:,.0f} img/s data-wait {100 * record['data_wait_frac']:.0f}%{gpu}"
        )
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(
                f"loss {loss:.3f} lr {lr:.3g} {rate:,.0f} img/s "
                f"wait {record['data_wait_ms']:.1f} ms{gpu}"
            )
            log.debug(line)
        else:
            log.info(line)
        self.restart_interval()
        return record

    def log_profile(self, step: int, mean_ms: dict[str, float]) -> None:
        """The profiled steps' mean breakdown as TensorBoard scalars (main process)."""
        self._emit(
            {"kind": "profile", "step": step, **mean_ms},
            {f"profile/{k}_ms": v for k, v in mean_ms.items() if k != "step"},
            step,
        )

    def log_eval(self, step: int, epoch: int, result: dict[str, float]) -> None:
        record = {"kind": "val", "step": step, "epoch": epoch, **result}
        self._emit(record, {"val/top1": result["top1"], "val/top5": result["top5"]}, step)
        log.info(
            "epoch %d val: top1 %.2f%% top5 %.2f%% over %d images",
            epoch,
            result["top1"],
            result["top5"],
            result["images"],
        )

    def steady_rate(self) -> float | None:
        """Steady-state img/s of this run's log intervals (``steady_rate`` below)."""
        return steady_rate(self.intervals)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory allocated by tensors on ``device`` (the allocator's count: no device sync)."""
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30
