"""The device side of the metrics: what a step adds to on the GPU, and what reads it back without
waiting.

- ``DeviceMeter`` sums each step's loss and correct count on the device (a CUDA graph records
  the additions); a log step's ``collect`` all-reduces them over ranks and copies them to pinned
  host memory behind a CUDA event (``Reading``), read an interval later, long complete.
- ``Clock`` marks intervals with CUDA events on the training stream (the host clock on the
  CPU), and ``StepTimer`` each step's GPU time, read with their interval.
- ``peak_memory_gib``: the allocator's peak, no device sync.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from fasttrain.dist.state import DistState


class Totals(NamedTuple):
    """An interval's figures over every rank."""

    loss: float  # mean loss per image
    top1: float  # %
    nonfinite: int  # losses that were not finite
    stops: int  # ranks that asked to stop
    skipped: int | None  # fp16: updates GradScaler skipped (an inf or NaN in the gradients)
    loss_scale: float | None  # fp16: GradScaler's scale after the interval's last update


class Reading:
    """An interval's totals over ranks, on their way to the host: ``values()`` waits for them
    (at once when read an interval later, their copy long done)."""

    def __init__(self, values: torch.Tensor, samples: int, world: int = 1):
        self.samples = samples  # over all ranks, counted on the host
        self.world = world  # the ranks summed: each added the same loss scale
        self.event = None
        if values.is_cuda:  # copied without waiting; the event says when it has landed
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def values(self) -> Totals:
        if self.event is not None:
            self.event.synchronize()
        loss_sum, correct, nonfinite, skipped, scale, stops = self.host.tolist()
        n = max(self.samples, 1)
        return Totals(
            loss_sum / n,
            100.0 * correct / n,
            int(nonfinite),
            int(stops),
            int(skipped) // self.world if scale > 0 else None,  # every rank skips alike
            scale / self.world if scale > 0 else None,
        )


class DeviceMeter:
    """Sum of per-batch loss x batch size and of correct predictions, and under fp16 the loss
    scale's course, kept on the device."""

    def __init__(self, device: torch.device, dist: DistState | None = None):
        self.dist = dist
        # loss x n, correct, non-finite losses, skipped updates, the last update's loss scale
        self.sums = torch.zeros(5, device=device)
        self.samples = 0  # this rank's, known on the host: no need to count it on the device

    def add_device(self, loss: torch.Tensor, correct: torch.Tensor, n: int) -> None:
        """Accumulate in place on the device (a CUDA graph can record this); the caller adds
        the ``n`` samples to ``samples`` on the host, once per step actually run."""
        bad = (~torch.isfinite(loss)).float()
        self.sums[:3] += torch.stack((loss.float() * n, correct.float(), bad))

    def add_update(self, scale_before: torch.Tensor, scale_after: torch.Tensor) -> None:
        """An fp16 update: GradScaler lowers its scale exactly when it skips one (an inf or NaN
        in the gradients); the scale it ends with is kept. On the device, capturable."""
        self.sums[3] += (scale_after < scale_before).float().squeeze()
        self.sums[4].copy_(scale_after.squeeze())

    def collect(self, stop: bool = False) -> Reading:
        """The totals since the last collect, over all ranks, with how many ranks ``stop``:
        the one all-reduce of a log step, enqueued, not waited for. Starts a new interval."""
        values = torch.empty(6, device=self.sums.device)
        values[:5].copy_(self.sums)
        values[5].fill_(float(stop))  # a kernel argument: no host-to-device copy
        world = 1
        if self.dist is not None:
            self.dist.all_reduce_(values, what="the all_reduce of the metrics at a log step")
            world = self.dist.world_size
        reading = Reading(values, self.samples * world, world)
        self.sums.zero_()
        self.samples = 0
        return reading

    def flush(self) -> tuple[float, float, int]:
        """(mean loss, top-1 %, samples) since the last flush, over all ranks, read at once:
        a host sync (tests and benchmarks; the trainer reads an interval late)."""
        reading = self.collect()
        totals = reading.values()
        return totals.loss, totals.top1, reading.samples


class Clock:
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


class StepTimer:
    """GPU time of each step, from CUDA events around it; averaged when a log step's interval is
    read."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def step(self) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.pairs.append((start, end))

    def take(self) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The event pairs of the steps since the last take, for ``stats_ms`` once they are done
        (a log step reads its interval an interval later)."""
        pairs, self.pairs = self.pairs, []
        return pairs

    @staticmethod
    def stats_ms(
        pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]],
    ) -> tuple[float | None, float | None]:
        """Mean and standard deviation of the GPU ms per step of ``pairs``, whose end events have
        completed. The spread says how even the steps are; under DDP a rank's steps also hold its
        waits for the other ranks in the all-reduce (None with fewer than two steps)."""
        times = [s.elapsed_time(e) for s, e in pairs]
        if not times:
            return None, None
        return statistics.fmean(times), statistics.pstdev(times) if len(times) > 1 else None


def peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory allocated by tensors on ``device`` (the allocator's count: no device sync);
    None on the CPU, which has no such count."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30
