"""Metrics: device-side accumulators, read every ``--log-every`` steps into the progress bar,
TensorBoard (``<run>/tb``) and ``metrics.jsonl``.

A log step does not wait for the GPU. It enqueues the interval's totals (all-reduced over ranks,
with each rank's stop request) into pinned host memory behind a CUDA event, and reads the
interval before it, whose event is ``--log-every`` steps old and long complete. So every log
line comes one interval late, and the steady state has no host sync at all. Throughput is
images over the time between two log steps' events on the training stream: what the GPU did,
its idle time included. ``Metrics(sync=True)`` is the simple reference, which the tests hold to
the same records: read at once, with a host sync (the GPU drains at every log step), timed on
the host clock between two synchronised reads.

Figures of two kinds say whether input holds the GPU back, and they differ. The host's share of
its own time spent getting batches comes in two parts: ``loader_wait_frac``, waiting for the
loader to hand one over (the host runs ahead, and with DALI it waits there for a batch whose
decoding shares the busy GPU), and ``copy_in_frac``, copying it to the device and normalising it
(``Loader.copy_clock``). ``gpu_idle_frac`` is the GPU's share of the interval outside the steps
(CUDA events around each step), which is what a starving loader, or a host that falls behind,
costs. The progress line shows the last, and the host's two only when the GPU idles too
(``progress_text``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fasttrain.metrics import board
from fasttrain.metrics.board import RankProfile
from fasttrain.metrics.meter import Clock, DeviceMeter, StepTimer, peak_memory_gib
from fasttrain.metrics.rates import progress_text, steady_rate

log = logging.getLogger("fasttrain")
# a train record's fields that TensorBoard shows, by tag; the GPU's figures are None on the CPU,
# the loss scale's without fp16, and a None is left out
SCALARS = {
    "loss": "train/loss",
    "top1": "train/top1",
    "lr": "train/lr",
    "img_per_s": "perf/img_per_s",
    "img_per_s_per_gpu": "perf/img_per_s_per_gpu",
    "loader_wait_frac": "perf/loader_wait_frac",
    "loader_wait_ms": "perf/loader_wait_ms",
    "copy_in_frac": "perf/copy_in_frac",
    "copy_in_ms": "perf/copy_in_ms",
    "gpu_step_ms": "perf/gpu_step_ms",
    "gpu_step_ms_sd": "perf/gpu_step_ms_sd",
    "gpu_idle_frac": "perf/gpu_idle_frac",
    "peak_mem_gib": "perf/peak_mem_gib",
    "loss_scale": "train/loss_scale",
    "skipped_steps": "train/skipped_steps",
}


@dataclass
class Logged:
    """A log step's record as written, and whether the ranks asked to stop in its interval."""

    record: dict[str, Any]
    stop: bool


class Metrics:
    """Owns the progress bar, TensorBoard writer and JSONL file (main process only), and the
    log steps' timing: one interval in flight between log steps (module notes)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        is_main: bool,
        total_steps: int,
        start_step: int,
        world_size: int,
        device: torch.device,
        sync: bool = False,
        timer: StepTimer | None = None,
    ):
        """``sync``: read each log step's interval at once, with a host sync (the reference).
        ``timer``: the steps' GPU times, read with their interval."""
        self.is_main = is_main
        self.timer = timer
        self.world_size = world_size
        self.device = device
        self.sync = sync
        self.clock = Clock(device, host=sync)
        self.intervals: list[tuple[int, int, float]] = []  # (epoch, images, seconds)
        self.pending: dict[str, Any] | None = None  # the interval read at the next log step
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

    def restart_interval(self, start: torch.cuda.Event | float | None = None) -> None:
        """Start a new timing interval: after compile, eval or a checkpoint (they are not
        steps), or at ``start``, the mark that ended the interval before."""
        self.t0 = self.clock.mark() if start is None else start
        self.host_t0 = time.perf_counter()
        if start is None and self.timer is not None:
            self.timer.take()  # steps outside any interval (the first, compiling one) are not timed
        self.images = 0
        self.loader_wait = self.copy_in = 0.0
        self.steps = 0

    def step_done(self, images: int, loader_wait: float, copy_in: float) -> None:
        """Host-side bookkeeping only; no device access. ``loader_wait`` and ``copy_in``: the
        host's seconds getting this step's batches, waiting for the loader and copying them to
        the device."""
        self.images += images
        self.loader_wait += loader_wait
        self.copy_in += copy_in
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
        self,
        step: int,
        epoch: int,
        meter: DeviceMeter,
        lr: float,
        stop: bool = False,
    ) -> list[Logged]:
        """A log step: close this interval (its totals over ranks, with this rank's ``stop``
        request) and write what is known: the interval before, read now that it has landed, or
        with ``sync`` this one, after a host sync."""
        reading = meter.collect(stop)
        if self.sync:
            reading.values()  # the host sync: this interval's work is done
        end = self.clock.mark()  # after the reading's copy, on the same stream
        interval = {
            "step": step,
            "epoch": epoch,
            "lr": lr,
            "reading": reading,
            "start": self.t0,
            "end": end,
            "images": self.images,
            "loader_wait": self.loader_wait,
            "copy_in": self.copy_in,
            "host_seconds": time.perf_counter() - self.host_t0,
            "steps": self.steps,
            "timed_steps": self.timer.take() if self.timer is not None else [],
            "peak_mem_gib": peak_memory_gib(self.device),
        }
        logged = self.settle()  # the interval before: its events are an interval old
        self.pending = interval
        if self.sync:
            logged += self.settle()
        self.restart_interval(start=end)
        return logged

    def settle(self, only_if_landed: bool = False) -> list[Logged]:
        """Read and write the interval in flight, if any (waiting for it: a host sync when it
        is the one just closed): before a checkpoint and at the end. ``only_if_landed``: not if
        that would wait (after a fault, when the GPU or a collective may never finish)."""
        if self.pending is None:
            return []
        # the end mark follows the reading's copy on the same stream (or, with ``sync``, the
        # reading was waited for already): once it has landed, so has the reading
        if only_if_landed and not self.clock.landed(self.pending["end"]):
            return []
        iv, self.pending = self.pending, None
        totals = iv["reading"].values()  # the interval's work is done
        loss, top1 = totals.loss, totals.top1
        elapsed = self.clock.seconds(iv["start"], iv["end"])
        rate = iv["images"] / elapsed if elapsed > 0 else 0.0
        self.intervals.append((iv["epoch"], iv["images"], elapsed))
        gpu_ms, gpu_sd = StepTimer.stats_ms(iv["timed_steps"])
        idle = None  # the GPU's share of the interval outside the steps
        if gpu_ms is not None and elapsed > 0:
            idle = max(0.0, 1.0 - gpu_ms * len(iv["timed_steps"]) / 1e3 / elapsed)
        host_s = iv["host_seconds"]
        record = {
            "kind": "train",
            "step": iv["step"],
            "epoch": iv["epoch"],
            "loss": loss,
            "nonfinite_losses": totals.nonfinite,
            "top1": top1,
            "lr": iv["lr"],
            "img_per_s": rate,
            "img_per_s_per_gpu": rate / self.world_size,
            "loader_wait_frac": iv["loader_wait"] / host_s if host_s > 0 else 0.0,
            "loader_wait_ms": 1e3 * iv["loader_wait"] / max(iv["steps"], 1),
            "copy_in_frac": iv["copy_in"] / host_s if host_s > 0 else 0.0,
            "copy_in_ms": 1e3 * iv["copy_in"] / max(iv["steps"], 1),
            "gpu_step_ms": gpu_ms,
            "gpu_step_ms_sd": gpu_sd,
            "gpu_idle_frac": idle,
            "peak_mem_gib": iv["peak_mem_gib"],
            "skipped_steps": totals.skipped,  # fp16: updates skipped for an inf in the gradients
            "loss_scale": totals.loss_scale,  # fp16: GradScaler's scale at the interval's end
        }
        scalars = {tag: record[key] for key, tag in SCALARS.items() if record[key] is not None}
        self._emit(record, scalars, iv["step"])
        line = (
            f"epoch {iv['epoch']} step {iv['step']}: loss {loss:.4f} top1 {top1:.1f}% "
            f"lr {iv['lr']:.4g} | {progress_text(rate, record)}"
        )
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix_str(
                f"loss {loss:.3f} lr {iv['lr']:.3g} | {progress_text(rate, record)}"
            )
            log.debug(line)
        else:
            log.info(line)
        return [Logged(record, totals.stops > 0)]

    def discard_pending(self) -> int | None:
        """Drop the interval in flight unread (its steps trained on weights just replaced);
        returns its step, if there was one."""
        step = self.pending["step"] if self.pending is not None else None
        self.pending = None
        return step

    def log_profile(
        self, step: int, mean_ms: dict[str, float] | None, ranks: list[RankProfile]
    ) -> None:
        """The profiled steps' breakdown (main process): this rank's mean as scalars
        (``profile/<part>_ms``) and a ``metrics.jsonl`` record, and every rank's breakdown and
        top kernels as TensorBoard text and a picture (``board.py``)."""
        if not self.is_main:
            return
        if mean_ms is not None:
            self._emit(
                {"kind": "profile", "step": step, **mean_ms},
                {f"profile/{k}_ms": v for k, v in mean_ms.items() if k != "step"},
                step,
            )
        board.write(self.writer, step, ranks)

    def log_eval(self, step: int, epoch: int, result: dict[str, float]) -> None:
        """An evaluation's figures; with --model-ema, the average's too (``ema_top1/5``)."""
        record = {"kind": "val", "step": step, "epoch": epoch, **result}
        scalars = {"val/top1": result["top1"], "val/top5": result["top5"]}
        ema = ""
        if "ema_top1" in result:
            scalars.update({"val/ema_top1": result["ema_top1"], "val/ema_top5": result["ema_top5"]})
            ema = f" | EMA top1 {result['ema_top1']:.2f}% top5 {result['ema_top5']:.2f}%"
        self._emit(record, scalars, step)
        log.info(
            "epoch %d val: top1 %.2f%% top5 %.2f%% over %d images%s",
            epoch,
            result["top1"],
            result["top5"],
            result["images"],
            ema,
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
