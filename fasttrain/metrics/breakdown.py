"""Where a step's time goes, computed from a torch.profiler (Kineto) trace.

Each profiled step is a window of the GPU timeline: from where the previous step's GPU work ended
to where the last piece of GPU work launched during this step's ``ProfilerStep#N`` annotation
ends (kernels are tied to their host launch by Kineto's correlation ids). The host's own window
is not used for the split: the host runs ahead of the GPU by up to several steps when nothing
throttles it (a graph replay is one launch), so its window is the launch time, not the step
time. Inside each window the GPU timeline (all streams merged) is split into four parts that
**partition the window exactly**, so they sum to the step time by construction:

- ``compute``: covered by any compute kernel (every kernel that is not NCCL);
- ``comm_exposed``: covered by NCCL kernels and no compute kernel;
- ``memory_exposed``: covered by memcpy/memset and neither of the above;
- ``idle``: covered by nothing.

Alongside, and overlapping those: ``comm`` (all NCCL kernel time, overlapped or not), ``memory``
(all memcpy/memset time), and from the host's window the host's time getting each step's data,
split in two that sum to it: ``host_copy_in`` (inside fasttrain's ``fasttrain.copy_in`` ranges
within its ``fasttrain.data`` ranges: copying the batch to the device and normalising it) and
``host_loader_wait`` (the rest of ``fasttrain.data``: waiting for the loader to hand a batch
over); and ``host_sync`` (host time in CUDA synchronize calls).

Kernels launched by a CUDA graph appear in the trace as ordinary kernels (CUPTI records them,
with the replay's launch as their correlation), so graph replays are counted like any other
work. The first profiled step starts where the host began it, and may hold GPU work launched before
profiling began (the previous graph replay, still running); the mean leaves it out. A step with no
GPU work (a CPU run, or a trace without correlation ids) keeps the host's window; in a CPU run
``compute`` is that window less the loader wait and sync, and those two are ``idle`` (the copy-in
is the host's own work there: it normalises the batch).

The classes follow HolisticTraceAnalysis: "nccl" in a kernel name is communication, Memcpy and
Memset are memory, every other kernel is computation.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STEP = re.compile(r"ProfilerStep#(\d+)")
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
PARTS = ("compute", "comm_exposed", "memory_exposed", "idle")


@dataclass
class StepTimes:
    """Milliseconds of one step (or their mean over steps)."""

    step: int
    total: float
    compute: float
    comm_exposed: float
    memory_exposed: float
    idle: float
    comm: float
    memory: float
    host_loader_wait: float
    host_copy_in: float
    host_sync: float

    def residual(self) -> float:
        """How far the four parts are from the step time (zero up to float rounding)."""
        return self.total - sum(getattr(self, p) for p in PARTS)


def load_trace(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of union ``a`` not covered by union ``b`` (both sorted and disjoint)."""
    out = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def classify(event: dict[str, Any]) -> str | None:
    """'comm', 'memory' or 'compute' for GPU activity; None for anything else."""
    cat = str(event.get("cat", "")).lower()
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memory"
    if cat == "kernel":
        return "comm" if "nccl" in str(event.get("name", "")).lower() else "compute"
    return None


def step_times(trace: dict[str, Any]) -> list[StepTimes]:
    """One ``StepTimes`` per ``ProfilerStep#N`` window in ``trace``."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": [], "memory": []}
    windows = []
    data_ranges, copy_ranges, sync_ranges = [], [], []
    launched_at: dict[Any, float] = {}  # correlation id -> host launch time
    gpu_events = []  # (end, correlation)
    for e in events:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        kind = classify(e)
        corr = (e.get("args") or {}).get("correlation")
        if kind is not None:
            gpu[kind].append((start, end))
            gpu_events.append((end, corr))
            continue
        if corr is not None:
            launched_at[corr] = start
        name = str(e.get("name", ""))
        m = STEP.fullmatch(name)
        if m:
            windows.append((int(m.group(1)), start, end))
        elif name == "fasttrain.data":
            data_ranges.append((start, end))
        elif name == "fasttrain.copy_in":
            copy_ranges.append((start, end))
        elif name in SYNC_CALLS:
            sync_ranges.append((start, end))
    windows.sort()
    compute = _union(gpu["compute"])
    comm = _union(gpu["comm"])
    memory = _union(gpu["memory"])
    busy = _union(compute + comm + memory)
    has_gpu = bool(busy)
    data_ranges, sync_ranges = _union(data_ranges), _union(sync_ranges)
    copy_ranges = _union(copy_ranges)
    copy_in_data = _minus(copy_ranges, _minus(copy_ranges, data_ranges))  # the intersection
    loader_ranges = _minus(data_ranges, copy_in_data)
    out = []
    for (n, host_lo, host_hi), (lo, hi) in zip(
        windows, _gpu_windows(windows, gpu_events, launched_at), strict=True
    ):
        ms = 1e-3
        c = _clip(compute, lo, hi)
        cm = _clip(comm, lo, hi)
        mem = _clip(memory, lo, hi)
        loader_wait = _length(_clip(loader_ranges, host_lo, host_hi)) * ms
        copy_in = _length(_clip(copy_in_data, host_lo, host_hi)) * ms
        sync = _length(_clip(sync_ranges, host_lo, host_hi)) * ms
        total = (hi - lo) * ms
        if has_gpu:
            comm_exposed = _minus(cm, c)
            memory_exposed = _minus(mem, _union(c + cm))
            idle = total - _length(_clip(busy, lo, hi)) * ms
            parts = (
                _length(c) * ms,
                _length(comm_exposed) * ms,
                _length(memory_exposed) * ms,
                idle,
            )
        else:  # a CPU run: the host's own time is the compute
            waits = loader_wait + sync
            parts = (max(0.0, total - waits), 0.0, 0.0, min(total, waits))
        out.append(
            StepTimes(
                n,
                total,
                *parts,
                comm=_length(cm) * ms,
                memory=_length(mem) * ms,
                host_loader_wait=loader_wait,
                host_copy_in=copy_in,
                host_sync=sync,
            )
        )
    return out


def window_of(starts: list[float], ends: list[float], at: float) -> int | None:
    """The index of the host window (sorted, disjoint: ``starts[i]`` to ``ends[i]``) in which a
    launch at ``at`` happened, or None: how a kernel is tied to the step that launched it."""
    i = bisect.bisect_right(starts, at) - 1
    return i if i >= 0 and at < ends[i] else None


def _gpu_windows(
    windows: list[tuple[int, float, float]],
    gpu_events: list[tuple[float, Any]],
    launched_at: dict[Any, float],
) -> list[tuple[float, float]]:
    """Each host step window's GPU window (see the module docstring), in the same order."""
    starts, ends = [lo for _, lo, _ in windows], [hi for _, _, hi in windows]
    last_end: dict[int, float] = {}  # window index -> end of its latest GPU work
    for end, corr in gpu_events:
        at = launched_at.get(corr) if corr is not None else None
        i = window_of(starts, ends, at) if at is not None else None
        if i is None:
            continue  # not tied to a launch, or launched outside every step
        last_end[i] = max(last_end.get(i, -math.inf), end)
    if not last_end:  # a CPU run, or no correlation ids: the host's windows
        return [(lo, hi) for _, lo, hi in windows]
    out = []
    prev = None
    for i, (_, host_lo, host_hi) in enumerate(windows):
        lo = host_lo if prev is None else prev
        # a step with no GPU work of its own runs on to its host window's end
        hi = max(lo, last_end.get(i, host_hi))
        out.append((lo, hi))
        prev = hi
    return out


def after_first(steps: list) -> list:
    """The steps a mean is taken over: all but the first, which may hold GPU work launched before
    profiling began (all of them if there is only one)."""
    return steps[1:] or steps


def mean(steps: list[StepTimes]) -> StepTimes | None:
    if not steps:
        return None
    fields = {k: sum(getattr(s, k) for s in steps) / len(steps) for k in asdict(steps[0])}
    fields["step"] = -1
    return StepTimes(**fields)


def summarize(path: str | Path, trace: dict[str, Any] | None = None) -> dict[str, Any]:
    """The breakdown of one trace file (``trace``: its contents, if already read): every step,
    their mean, and the rank it came from."""
    trace = load_trace(path) if trace is None else trace
    steps = step_times(trace)
    avg = mean(after_first(steps))
    return {
        "trace": str(path),
        "rank": (trace.get("distributedInfo") or {}).get("rank"),
        "steps": [asdict(s) for s in steps],
        "mean_ms": asdict(avg) if avg else None,
        "residual_ms": max((abs(s.residual()) for s in steps), default=0.0),
        "device": "gpu" if any(classify(e) for e in trace.get("traceEvents", [])) else "cpu",
    }


def find_traces(root: str | Path) -> list[Path]:
    root = Path(root)
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.pt.trace.json*") if p.is_file())


def table(summary: dict[str, Any]) -> str:
    """A few lines: the mean step's parts, in ms and as shares of the step."""
    m = summary["mean_ms"]
    if m is None:
        return f"{summary['trace']}: no profiled steps"
    total = m["total"] or 1.0
    rank = summary["rank"]
    lines = [
        f"step time breakdown, rank {rank if rank is not None else '?'}, mean of "
        f"{max(len(summary['steps']) - 1, 1)} steps after the first ({summary['trace']}):",
        f"  {'step':<22s}{m['total']:9.2f} ms",
    ]
    labels = {
        "compute": "compute kernels",
        "comm_exposed": "NCCL, not overlapped",
        "memory_exposed": "memcpy/memset, alone",
        "idle": "GPU idle",
    }
    if summary.get("device") == "cpu":  # no GPU activity: the host's own split
        labels.update(compute="host computing", idle="host waiting")
    for part in PARTS:
        lines.append(f"  {labels[part]:<22s}{m[part]:9.2f} ms {100 * m[part] / total:5.1f}%")
    lines.append(
        f"  (overlapping: NCCL total {m['comm']:.2f} ms, memcpy/memset total {m['memory']:.2f} "
        f"ms; host waiting for the loader {m['host_loader_wait']:.2f} ms, copying to the "
        f"device {m['host_copy_in']:.2f} ms, in sync calls {m['host_sync']:.2f} ms; the four "
        f"parts sum to the step within {summary['residual_ms']:.3f} ms)"
    )
    return "\n".join(lines)
