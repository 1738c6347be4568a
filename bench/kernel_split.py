"""Which kernels a step's GPU time goes to, from a ``--profile`` trace: convolutions, matmuls,
inductor's Triton kernels (BatchNorm statistics and normalise, ReLU, the residual add, their
backward, the optimizer when compiled), communication, copies. ``breakdown.py`` answers
"compute, communication or idle?"; this answers "which compute?", which is where a fusion's
saving should show.

Usage: python bench/kernel_split.py RUN/profile/rank0.*.pt.trace.json [--top 15]

Times are summed per kernel class over the kernels the profiled steps launched and divided by
their number (the ``ProfilerStep#N`` annotations); the table of the longest kernels shows what
each class holds. A kernel belongs to a step when its host launch (Kineto's correlation id; a
graph replay's kernels carry the replay's launch) lies inside that step's annotation. The host
runs ahead of the GPU, so a trace also records kernels launched before profiling began (the
graph replays still running): left out, or a 3-step trace of the graphed ResNet-50 step holds
nearly 4 steps of kernels. A trace without correlation ids counts every kernel.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

from fasttrain.metrics.breakdown import window_of

# (class, substrings of a kernel's lower-cased name), first match wins
CLASSES = (
    ("communication (NCCL)", ("nccl",)),
    ("inductor / Triton", ("triton_",)),
    ("BatchNorm (cuDNN)", ("nhwc_batch_norm", "bn_fw", "bn_bw")),  # --cudnn-bn's kernels
    ("convolution (cuDNN)", ("conv", "fprop", "dgrad", "wgrad", "implicit", "genstats")),
    ("matmul (cuBLAS)", ("gemm", "nvjet", "cublas")),
    ("convolution (cuDNN)", ("xmma", "cudnn", "cutlass")),  # the rest of cuDNN's engines
)


def classify(name: str, category: str) -> str:
    """The class of one GPU event: copies and fills by their category, kernels by name."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copies and fills"
    low = name.lower()
    for label, needles in CLASSES:
        if any(n in low for n in needles):
            return label
    return "other kernels"


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def split(trace: dict) -> tuple[int, dict[str, float], dict[str, float]]:
    """(profiled steps, ms per class, ms per kernel name), summed over the kernels the steps
    launched (module notes)."""
    events = trace.get("traceEvents", [])
    annotations = [
        e
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    in_steps = _launched_in_steps(events, annotations)
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        if in_steps is not None and _correlation(e) not in in_steps:
            continue
        ms = e["dur"] / 1000.0
        by_class[classify(e.get("name", ""), cat)] += ms
        by_name[e.get("name", "")] += ms
    return max(len(annotations), 1), dict(by_class), dict(by_name)


def _correlation(event: dict) -> object:
    return (event.get("args") or {}).get("correlation")


def _launched_in_steps(events: list[dict], annotations: list[dict]) -> set | None:
    """The correlation ids of host launches inside a ``ProfilerStep#N`` annotation, or None
    where the trace cannot say (no timed annotations, or no kernel tied to a host launch)."""
    windows = sorted(
        (float(a["ts"]), float(a["ts"]) + float(a["dur"]))
        for a in annotations
        if "ts" in a and "dur" in a
    )
    gpu = {"kernel", "gpu_memcpy", "gpu_memset"}
    launched = {
        _correlation(e): float(e["ts"])
        for e in events
        if e.get("cat") not in gpu and _correlation(e) is not None and "ts" in e
    }
    if not windows or not any(_correlation(e) in launched for e in events if e.get("cat") in gpu):
        return None
    starts, ends = [lo for lo, _ in windows], [hi for _, hi in windows]
    return {corr for corr, at in launched.items() if window_of(starts, ends, at) is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=15, help="longest kernels to list")
    args = p.parse_args()
    steps, by_class, by_name = split(load(args.trace))
    total = sum(by_class.values()) or 1.0
    print(f"{args.trace.name}: {steps} profiled steps, {total / steps:.2f} ms of GPU work per step")
    print("\n| kernels | ms per step | share |\n|---|---:|---:|")
    for label, ms in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {ms / steps:.2f} | {100 * ms / total:.1f}% |")
    print("\n| kernel | class | ms per step |\n|---|---|---:|")
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| `{name[:90]}` | {classify(name, 'kernel')} | {ms / steps:.3f} |")


if __name__ == "__main__":
    main()
