"""Which kernels a step's GPU time goes to, from a ``--profile`` trace, as markdown tables: the
GPU time per kernel class (convolution, GEMM, Triton, NCCL, copies) and the longest kernels.
The classes and how kernels are tied to steps: ``fasttrain/metrics/kernels.py``. A ``--profile``
run also writes these tables into TensorBoard's Text dashboard (``profile/top_kernels``).

Usage: python bench/kernel_split.py RUN/profile/rank0.*.pt.trace.json [--top 15]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fasttrain.metrics.breakdown import load_trace
from fasttrain.metrics.kernels import split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=15, help="longest kernels to list")
    args = p.parse_args()
    s = split(load_trace(args.trace))
    total = sum(s.by_class.values()) or 1.0
    print(
        f"{args.trace.name}: {s.steps} profiled steps, {s.per_step():.2f} ms of GPU work per step"
    )
    print("\n| kernels | ms per step | share |\n|---|---:|---:|")
    for label, ms in sorted(s.by_class.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {ms / s.steps:.2f} | {100 * ms / total:.1f}% |")
    print("\n| kernel | class | ms per step |\n|---|---|---:|")
    for name, label, ms in s.top(args.top):
        print(f"| `{name[:90]}` | {label} | {ms:.3f} |")


if __name__ == "__main__":
    main()
