"""Which kernels a step's GPU time goes to, from a ``--profile`` trace: convolutions, GEMMs,
Triton's kernels (inductor's BatchNorm statistics and normalise, ReLU, the residual add, their
backward, the optimizer when compiled; and fasttrain's own), NCCL, copies, and DALI's decode
kernels, which share the GPU with the step. ``breakdown.py`` answers "compute, communication or
idle?"; this answers "which compute?", which is where a fusion's saving should show.

Times are summed per kernel class over the kernels the profiled steps launched and divided by
their number (the ``ProfilerStep#N`` annotations). A kernel belongs to a step when its host
launch (Kineto's correlation id; a graph replay's kernels carry the replay's launch) lies inside
that step's annotation. The host runs ahead of the GPU, so a trace also records kernels launched
before profiling began (the graph replays still running): they are left out, or a 3-step trace of
the graphed ResNet-50 step would hold nearly 4 steps of kernels. A trace without correlation ids
counts every kernel.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fasttrain.metrics.breakdown import window_of

NCCL = "NCCL"
COPIES = "copies and fills"
OTHER = "other kernels"
# (class, substrings of a kernel's lower-cased name), first match wins; the loader's kernels
# before the convolutions, whose needles they hold ("RGBAToRGBConversion")
CLASSES = (
    (NCCL, ("nccl",)),
    ("data loading (DALI, nvJPEG)", ("nvjpeg", "dali::", "nvimgcodec")),
    ("Triton (BN, elementwise)", ("triton_",)),
    ("BatchNorm (cuDNN)", ("nhwc_batch_norm", "bn_fw", "bn_bw")),  # --cudnn-bn's kernels
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "implicit", "genstats")),
    ("GEMM (cuBLAS)", ("gemm", "nvjet", "cublas")),
    ("convolution", ("xmma", "cudnn", "cutlass")),  # the rest of cuDNN's engines
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def classify(name: str, category: str = "kernel") -> str:
    """The class of one GPU event: copies and fills by their category (or, without it, by
    the names Kineto gives them), kernels by name."""
    low = name.lower()
    if category in ("gpu_memcpy", "gpu_memset") or low.startswith(("memcpy ", "memset ")):
        return COPIES
    for label, needles in CLASSES:
        if any(n in low for n in needles):
            return label
    return OTHER


@dataclass
class KernelSplit:
    """GPU milliseconds by class and by kernel name, summed over ``steps`` profiled steps."""

    steps: int = 0
    by_class: dict[str, float] = field(default_factory=dict)
    by_name: dict[str, float] = field(default_factory=dict)

    def add(self, other: KernelSplit) -> KernelSplit:
        """Both traces' kernels together (one rank's cycles)."""
        out = KernelSplit(self.steps + other.steps, dict(self.by_class), dict(self.by_name))
        for mine, theirs in ((out.by_class, other.by_class), (out.by_name, other.by_name)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v
        return out

    def per_step(self) -> float:
        """GPU milliseconds per step, all classes."""
        return sum(self.by_class.values()) / max(self.steps, 1)

    def top(self, n: int) -> list[tuple[str, str, float]]:
        """The ``n`` kernels with the most GPU time: (name, class, ms per step)."""
        ranked = sorted(self.by_name.items(), key=lambda kv: -kv[1])[:n]
        return [(name, classify(name), ms / max(self.steps, 1)) for name, ms in ranked]

    def tables(self, top: int) -> list[str]:
        """Markdown: GPU time per step by class with its share, and the ``top`` longest
        kernels with their class."""
        steps = max(self.steps, 1)
        out = ["| kernel class | ms per step | share of GPU time |", "|---|---:|---:|"]
        for label, share in self.shares().items():
            out.append(f"| {label} | {self.by_class[label] / steps:.2f} | {100 * share:.1f}% |")
        out += ["", "| kernel | class | ms per step |", "|---|---|---:|"]
        for name, label, ms in self.top(top):
            short = name if len(name) <= 100 else name[:97] + "..."
            out.append(f"| `{short.replace('|', '/')}` | {label} | {ms:.3f} |")
        return out

    def shares(self) -> dict[str, float]:
        """Each class's share of the GPU time, largest first."""
        total = sum(self.by_class.values()) or 1.0
        ranked = sorted(self.by_class.items(), key=lambda kv: -kv[1])
        return {k: v / total for k, v in ranked}


def split(trace: dict[str, Any]) -> KernelSplit:
    """The kernels the trace's profiled steps launched (module notes)."""
    steps, work = profiled_work(trace)
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e, _ in work:
        ms = e["dur"] / 1000.0
        by_class[classify(e.get("name", ""), e.get("cat", ""))] += ms
        by_name[e.get("name", "")] += ms
    return KernelSplit(steps, dict(by_class), dict(by_name))


def profiled_work(trace: dict[str, Any]) -> tuple[int, list[tuple[dict, int]]]:
    """The number of profiled steps (at least 1), and the GPU work (kernels, copies, fills) they
    launched, each event with the index of its step in time order (module notes). Without
    correlation ids every piece of GPU work counts, as step 0."""
    events = trace.get("traceEvents", [])
    annotations = step_annotations(events)
    steps_of = launched_in_steps(events, annotations)
    work = []
    for e in events:
        if e.get("cat", "") not in GPU_CATEGORIES or "dur" not in e:
            continue
        step = 0 if steps_of is None else steps_of.get(correlation(e))
        if step is not None:
            work.append((e, step))
    return max(len(annotations), 1), work


def correlation(event: dict) -> object:
    return (event.get("args") or {}).get("correlation")


def step_annotations(events: list[dict]) -> list[dict]:
    """The trace's ``ProfilerStep#N`` annotations, one per profiled step."""
    return [
        e
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]


def launched_in_steps(events: list[dict], annotations: list[dict]) -> dict | None:
    """Each host launch inside a ``ProfilerStep#N`` annotation, by correlation id: the index of
    its step (in time order). None where the trace cannot say (no timed annotations, or no
    kernel tied to a host launch)."""
    windows = sorted(
        (float(a["ts"]), float(a["ts"]) + float(a["dur"]))
        for a in annotations
        if "ts" in a and "dur" in a
    )
    launched = {
        correlation(e): float(e["ts"])
        for e in events
        if e.get("cat") not in GPU_CATEGORIES and correlation(e) is not None and "ts" in e
    }
    tied = any(correlation(e) in launched for e in events if e.get("cat") in GPU_CATEGORIES)
    if not windows or not tied:
        return None
    starts, ends = [lo for lo, _ in windows], [hi for _, hi in windows]
    steps = {corr: window_of(starts, ends, at) for corr, at in launched.items()}
    return {corr: i for corr, i in steps.items() if i is not None}
