"""Profiler hooks: ``--profile`` traces, named ranges, and the always-on step timers.

- ``RunProfiler`` drives ``torch.profiler`` on a wait/warm-up/active/repeat schedule and writes
  one trace per rank and cycle through ``tensorboard_trace_handler`` under ``<run>/profile``
  (TensorBoard's PyTorch Profiler plugin lists them; Perfetto opens them). Every trace carries
  ``distributedInfo``, single-process runs included, as HolisticTraceAnalysis needs.
- ``span(name)`` marks a phase (data fetch, copy-in, step, optimizer, eval) both in the trace
  (``record_function``) and for Nsight Systems (NVTX), when profiling or on a GPU.
- ``StepTimer`` times each step on the GPU with CUDA events; the times are read with their log
  interval, an interval later, when they are long complete, so it adds no sync.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from fasttrain.config import RunConfig
from fasttrain.distributed import DistState

log = logging.getLogger("fasttrain")


class RunProfiler:
    def __init__(self, cfg: RunConfig, run_dir: Path, dist: DistState):
        self.enabled = cfg.profile
        self.dist = dist
        self.trace_dir = Path(run_dir) / "profile"
        self.prof: torch.profiler.profile | None = None
        self.cycles = 0
        if not self.enabled:
            return
        from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if dist.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.handler = tensorboard_trace_handler(
            str(self.trace_dir), worker_name=f"rank{dist.rank}"
        )
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.profile_wait,
                warmup=cfg.profile_warmup,
                active=cfg.profile_active,
                repeat=cfg.profile_repeat,
            ),
            on_trace_ready=self._ready,
        )

    def _ready(self, prof: torch.profiler.profile) -> None:
        self.handler(prof)
        self.cycles += 1
        log.info(
            "profiler: wrote trace %d of rank %d to %s", self.cycles, self.dist.rank, self.trace_dir
        )

    def start(self) -> None:
        if self.prof is not None:
            self.prof.start()
            self._tag()

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()
            self._tag()

    def _tag(self) -> None:
        """torch writes ``distributedInfo`` only with a process group; write it always."""
        if not self.dist.distributed:
            info = {"backend": "none", "rank": self.dist.rank, "world_size": 1}
            self.prof.add_metadata_json("distributedInfo", json.dumps(info))

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def traces(self) -> list[Path]:
        return sorted(self.trace_dir.glob(f"rank{self.dist.rank}.*.pt.trace.json*"))


_RECORD = False  # record_function ranges (while --profile is on)
_NVTX = False  # NVTX ranges (on a GPU)


def configure(record: bool, nvtx: bool) -> None:
    """Turn the named ranges on for this process (train() calls it once)."""
    global _RECORD, _NVTX
    _RECORD, _NVTX = record, nvtx


@contextmanager
def span(name: str) -> Iterator[None]:
    """A named range in the profiler trace and, on a GPU, for Nsight Systems (NVTX)."""
    if not (_RECORD or _NVTX):
        yield
        return
    with torch.profiler.record_function(name) if _RECORD else nullcontext():
        if _NVTX:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if _NVTX:
                torch.cuda.nvtx.range_pop()


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
