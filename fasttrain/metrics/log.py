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

Two figures say whether input holds the GPU back, and they differ: ``data_wait_frac`` is the
host's share of its own time spent fetching batches (the host runs ahead, and with DALI it waits
there for a batch whose decoding shares the busy GPU); ``gpu_idle_frac`` is the GPU's
share of the interval outside the steps (CUDA events around each step), which is what a starving
loader, or a host that falls behind, costs. The progress line shows the second, and the first
only when the GPU idles too (``progress_text``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fasttrain.dist.state import DistState
from fasttrain.metrics.profiling import StepTimer

log = logging.getLogger("fasttrain")


class Reading:
    """An interval's totals over ranks, on their way to the host: ``values()`` waits for them
    (at once when read an interval later, their copy long done)."""

    def __init__(self, values: torch.Tensor, samples: int):
        self.samples = samples  # over all ranks, counted on the host
        self.event = None
        if values.is_cuda:  # copied without waiting; the event says when it has landed
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def values(self) -> tuple[float, float, int, int]:
        """(mean loss, top-1 %, non-finite losses, ranks that asked to stop)."""
        if self.event is not None:
            self.event.synchronize()
        loss_sum, correct, nonfinite, stops = self.host.tolist()
        n = max(self.samples, 1)
        return loss_sum / n, 100.0 * correct / n, int(nonfinite), int(stops)


class DeviceMeter:
    """Sum of per-batch loss x batch size and of correct predictions, kept on the device."""

    def __init__(self, device: torch.device, dist: DistState | None = None):
        self.dist = dist
        self.sums = torch.zeros(3, device=device)  # loss x n, correct, non-finite losses
        self.samples = 0  # this rank's, known on the host: no need to count it on the device

    def add_device(self, loss: torch.Tensor, correct: torch.Tensor, n: int) -> None:
        """Accumulate in place on the device (a CUDA graph can record this); the caller adds
        the ``n`` samples to ``samples`` on the host, once per step actually run."""
        bad = (~torch.isfinite(loss)).float()
        self.sums += torch.stack((loss.float() * n, correct.float(), bad))

    def collect(self, stop: bool = False) -> Reading:
        """The totals since the last collect, over all ranks, with how many ranks ``stop``:
        the one all-reduce of a log step, enqueued, not waited for. Starts a new interval."""
        values = torch.empty(4, device=self.sums.device)
        values[:3].copy_(self.sums)
        values[3].fill_(float(stop))  # a kernel argument: no host-to-device copy
        world = 1
        if self.dist is not None:
            self.dist.all_reduce_(values, what="the all_reduce of the metrics at a log step")
            world = self.dist.world_size
        reading = Reading(values, self.samples * world)
        self.sums.zero_()
        self.samples = 0
        return reading

    def flush(self) -> tuple[float, float, int]:
        """(mean loss, top-1 %, samples) since the last flush, over all ranks, read at once:
        a host sync (tests and benchmarks; the trainer reads an interval late)."""
        reading = self.collect()
        loss, top1, _, _ = reading.values()
        return loss, top1, reading.samples


class _Clock:
    """Interval marks: CUDA events on the training stream on a GPU, read once complete, so that
    marking never waits; on the CPU the host clock (work is done when its call returns)."""

    def __init__(self, device: torch.device, host: bool):
        self.events = device.type == "cuda" and not host

    def mark(self) -> torch.cuda.Event | float:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def landed(self, mark: torch.cuda.Event | float) -> bool:
        return not self.events or mark.query()

    def seconds(self, start: torch.cuda.Event | float, end: torch.cuda.Event | float) -> float:
        """Between two marks; on a GPU, once the interval's reading has landed (``end`` was
        recorded just after its copy, so this wait is as short)."""
        if self.events:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


@dataclass
class Logged:
    """A log step's record as written, and whether the ranks asked to stop in its interval."""

    record: dict[str, Any]
    stop: bool


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


def rates_by(
    intervals: Sequence[tuple[int, float, float]], key: Callable[[int], Any]
) -> dict[Any, float | None]:
    """``steady_rate`` of each group of intervals that ``key(epoch)`` makes (e.g. the train size
    of ``--progressive-resizing``), each group read as a run of its own."""
    groups: dict[Any, list[tuple[int, float, float]]] = {}
    for iv in intervals:
        groups.setdefault(key(iv[0]), []).append(iv)
    return {k: steady_rate(v) for k, v in groups.items()}


INPUT_BOUND = 0.05  # the GPU idle (and the host waiting for data) this share of the time


def progress_text(rate: float, record: dict[str, Any]) -> str:
    """What limits the run, for the progress line: img/s, how busy the GPU was, and the
    loader's share only when the run actually waits for data. With DALI the host waits in the
    loader most of the time while the GPU is busy (decode shares the GPU): that wait is not a
    bottleneck, so it is shown only when the GPU was idle too (on the CPU, where the host does
    the work, when the host waited)."""
    text = f"{rate:,.0f} img/s"
    idle, wait = record["gpu_idle_frac"], record["data_wait_frac"]
    if idle is not None:
        text += f", GPU busy {100 * (1 - idle):.1f}%"
        if record["gpu_step_ms"] is not None:
            text += f" ({record['gpu_step_ms']:.1f} ms/step)"
    if wait >= INPUT_BOUND and (idle is None or idle >= INPUT_BOUND):
        text += f", waiting for data {100 * wait:.0f}% of the time"
    return text


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
        self.clock = _Clock(device, host=sync)
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
            "data_wait": self.data_wait,
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
        loss, top1, nonfinite, stops = iv["reading"].values()  # the interval's work is done
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
            "nonfinite_losses": nonfinite,
            "top1": top1,
            "lr": iv["lr"],
            "img_per_s": rate,
            "img_per_s_per_gpu": rate / self.world_size,
            "data_wait_frac": iv["data_wait"] / host_s if host_s > 0 else 0.0,
            "data_wait_ms": 1e3 * iv["data_wait"] / max(iv["steps"], 1),
            "gpu_step_ms": gpu_ms,
            "gpu_step_ms_sd": gpu_sd,
            "gpu_idle_frac": idle,
            "peak_mem_gib": iv["peak_mem_gib"],
        }
        scalars = {
            "train/loss": loss,
            "train/top1": top1,
            "train/lr": iv["lr"],
            "perf/img_per_s": rate,
            "perf/img_per_s_per_gpu": record["img_per_s_per_gpu"],
            "perf/data_wait_frac": record["data_wait_frac"],
            "perf/data_wait_ms": record["data_wait_ms"],
            "perf/gpu_step_ms": gpu_ms,  # the GPU figures: none on the CPU
            "perf/gpu_step_ms_sd": gpu_sd,
            "perf/gpu_idle_frac": idle,
            "perf/peak_mem_gib": record["peak_mem_gib"],  # the GPU's: none on the CPU
        }
        self._emit(record, {k: v for k, v in scalars.items() if v is not None}, iv["step"])
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
        return [Logged(record, stops > 0)]

    def discard_pending(self) -> int | None:
        """Drop the interval in flight unread (its steps trained on weights just replaced);
        returns its step, if there was one."""
        step = self.pending["step"] if self.pending is not None else None
        self.pending = None
        return step

    def log_profile(self, step: int, mean_ms: dict[str, float]) -> None:
        """The profiled steps' mean breakdown as TensorBoard scalars (main process)."""
        self._emit(
            {"kind": "profile", "step": step, **mean_ms},
            {f"profile/{k}_ms": v for k, v in mean_ms.items() if k != "step"},
            step,
        )

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


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory allocated by tensors on ``device`` (the allocator's count: no device sync);
    None on the CPU, which has no such count."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
