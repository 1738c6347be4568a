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
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from fasttrain.config import RunConfig
from fasttrain.dist.state import DistState
from fasttrain.metrics.board import RankProfile

log = logging.getLogger("fasttrain")


class RunProfiler:
    def __init__(self, cfg: RunConfig, run_dir: Path, dist: DistState, steps: int):
        """``steps``: how many steps this run will train, to warn when the schedule's first
        recording would come after the run has ended."""
        self.enabled = cfg.profile
        self.dist = dist
        self.trace_dir = Path(run_dir) / "profile"
        self.prof: torch.profiler.profile | None = None
        self.cycles = 0
        self.steps_seen = 0
        if not self.enabled:
            return
        self.needed = cfg.profile_wait + cfg.profile_warmup + cfg.profile_active
        if steps < self.needed and dist.is_main:
            log.warning("--profile: %s", self.too_short(steps))
        from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if dist.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        else:
            # without a GPU, kineto logs its start and stop and a failed GPU count at every
            # cycle, nothing a CPU run can act on (its level is read when it first starts)
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
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
        if not dist.distributed:  # torch writes distributedInfo only with a process group
            info = {"backend": "none", "rank": dist.rank, "world_size": 1}
            # preset: written into every cycle's trace as it starts recording (metadata added
            # while the profiler waits finds no trace to go into)
            self.prof.preset_metadata_json("distributedInfo", json.dumps(info))

    def too_short(self, steps: int) -> str:
        return (
            f"this run trains {steps} step{'s' if steps != 1 else ''}, but the profiler "
            f"records only after --profile-wait + --profile-warmup + --profile-active = "
            f"{self.needed} steps, so it writes no trace; lower --profile-wait, or raise "
            "--max-steps"
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

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()
            self.steps_seen += 1

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
            if self.cycles == 0 and self.dist.is_main:
                log.warning("--profile: no trace written: %s", self.too_short(self.steps_seen))

    def traces(self) -> list[Path]:
        return sorted(self.trace_dir.glob(f"rank{self.dist.rank}.*.pt.trace.json*"))


TOP_GAPS = 8  # neighbour pairs listed in the idle-gap table
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


def report_profile(
    profiler: RunProfiler,
    log_profile: Callable[[int, dict[str, float] | None, list[RankProfile]], None],
    step: int,
    gather: Callable[[RankProfile], list[RankProfile]] | None = None,
) -> dict[str, Any]:
    """This rank's breakdown of each trace and its kernels: logged as a table, saved as JSON, and
    handed to ``log_profile`` (TensorBoard, from the main process) with every rank's, which
    ``gather`` collects (an all-gather; None after a fault, when only this rank's is safe)."""
    from dataclasses import asdict

    from fasttrain.metrics.breakdown import (
        StepTimes,
        after_first,
        load_trace,
        mean,
        summarize,
        table,
    )
    from fasttrain.metrics.gaps import Gaps, gaps
    from fasttrain.metrics.kernels import KernelSplit, split

    summaries, kernels, idle = [], KernelSplit(), Gaps()
    for p in profiler.traces():
        trace = load_trace(p)  # each trace read once
        summaries.append(summarize(p, trace))
        kernels = kernels.add(split(trace))
        idle = idle.add(gaps(trace))
    for s in summaries:
        log.info("%s", table(s))
    on_gpu = bool(kernels.by_class)  # GPU work: where its idle time sits
    if on_gpu:
        log.info("GPU idle inside the profiled steps:\n%s", "\n".join(idle.tables(TOP_GAPS)))
    overall = mean([StepTimes(**st) for s in summaries for st in after_first(s["steps"])])
    out = {
        "traces": summaries,
        "mean_ms": asdict(overall) if overall else None,
        "idle_gaps": idle.as_dict(TOP_GAPS) if on_gpu else None,
    }
    path = profiler.trace_dir / f"breakdown-rank{profiler.dist.rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    run_dir = profiler.trace_dir.parent
    mine = RankProfile(
        rank=profiler.dist.rank,
        traces=[str(Path(s["trace"]).relative_to(run_dir)) for s in summaries],
        mean_ms=out["mean_ms"],
        device="gpu" if any(s["device"] == "gpu" for s in summaries) else "cpu",
        kernels=kernels,
        gaps=idle,
    )
    ranks = gather(mine.compact()) if gather is not None else [mine]
    log_profile(step, out["mean_ms"], ranks)
    return {"breakdown": str(path), "mean_ms": out["mean_ms"]}
