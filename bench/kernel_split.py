"""Which kernels a step's GPU time goes to, from a ``--profile`` trace, as markdown tables: the
GPU time per kernel class (convolution, GEMM, Triton, NCCL, copies) and the longest kernels;
then where the GPU sat idle inside the steps: the gaps by length and by the kernel classes on
either side. The classes and how kernels are tied to steps: ``fasttrain/metrics/kernels.py``;
the gaps: ``fasttrain/metrics/gaps.py``. A ``--profile`` run also writes these tables into
TensorBoard's Text dashboard (``profile/top_kernels``, ``profile/idle_gaps``).

Usage: python bench/kernel_split.py RUN/profile/rank0.*.pt.trace.json [--top 15]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fasttrain.metrics.breakdown import load_trace
from fasttrain.metrics.gaps import gaps
from fasttrain.metrics.kernels import split


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=15, help="longest kernels to list")
    args = p.parse_args()
    trace = load_trace(args.trace)
    s = split(trace)
    print(
        f"{args.trace.name}: {s.steps} profiled steps, {s.per_step():.2f} ms of GPU work per step"
    )
    print()
    print("\n".join(s.tables(args.top)))
    print()
    print("\n".join(gaps(trace).tables(args.top)))


if __name__ == "__main__":
    main()
