"""How fast each of inductor's kernels moves its bytes in a profiled step: a ``--profile``
trace's kernel times joined with inductor's own estimate of each kernel's bytes (the least it
must read and write), as a markdown table, with the time-weighted mean bandwidth and what the
kernels would take at a given bandwidth.

Inductor writes the estimate into a kernel's source (``'kernel_num_gb'`` in its
``inductor_meta``) when ``TORCHINDUCTOR_BENCHMARK_KERNEL=1`` is set while it compiles; the source
files lie in inductor's cache (fasttrain's ``--compile-cache`` folder, a folder per set of
settings). So compile and profile one run with it set, on caches that hold no other settings'
kernels, and point this at the trace and the cache::

    TORCHINDUCTOR_BENCHMARK_KERNEL=1 FASTTRAIN_CACHE=/tmp/bw python -m fasttrain --loader \\
        synthetic --compile --cuda-graphs --profile --max-steps 60 --output-dir /tmp/bw-run
    python bench/kernel_bandwidth.py /tmp/bw-run/profile/rank0.*.pt.trace.json /tmp/bw/compile

The setting changes no kernel, only the benchmark helpers beside each. Kernels are tied to the
profiled steps as ``bench/kernel_split.py`` ties them. Kernel names repeat across compiled
graphs (each graph numbers its kernels from 0): a name found with two different byte counts is
left out of the bandwidth and counted as ambiguous.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fasttrain.metrics.breakdown import load_trace
from fasttrain.metrics.kernels import profiled_work

NUM_GB = re.compile(r"'kernel_num_gb':\s*([0-9.eE+-]+)")
DEF = re.compile(r"\ndef\s+(\w+)\s*\(")


def kernel_bytes(sources: list[Path]) -> tuple[dict[str, float], set[str]]:
    """Each kernel's estimated bytes, by name, from inductor's generated sources under
    ``sources`` (files or folders, searched for ``*.py``); and the names found with different
    estimates (left out of the first)."""
    found: dict[str, set[float]] = defaultdict(set)
    files = [p for s in sources for p in ([s] if s.is_file() else sorted(s.rglob("*.py")))]
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for m in NUM_GB.finditer(text):
            name = DEF.search(text, m.end())
            if name is not None:
                found[name.group(1)].add(float(m.group(1)) * 1e9)
    ambiguous = {n for n, values in found.items() if len(values) > 1}
    return {n: next(iter(v)) for n, v in found.items() if n not in ambiguous}, ambiguous


@dataclass
class KernelRate:
    """One kernel over the profiled steps: calls and µs per step, bytes per call."""

    name: str
    calls: float
    us: float
    bytes_per_call: float | None

    def tb_per_s(self) -> float | None:
        if self.bytes_per_call is None or self.us <= 0:
            return None
        return self.bytes_per_call * self.calls / (self.us * 1e-6) / 1e12


def rates(trace: dict[str, Any], estimates: dict[str, float]) -> list[KernelRate]:
    """Inductor's kernels (``triton_`` names) of the trace's profiled steps, per step, slowest
    first, each with its estimated bytes where known."""
    steps, work = profiled_work(trace)
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for e, _ in work:
        name = str(e.get("name", ""))
        if e.get("cat") == "kernel" and name.startswith("triton_"):
            calls[name] += 1
            us[name] += float(e["dur"])
    out = [KernelRate(n, calls[n] / steps, us[n] / steps, estimates.get(n)) for n in calls]
    return sorted(out, key=lambda k: -k.us)


def summary(kernels: list[KernelRate], at_tb_s: float) -> list[str]:
    """The totals: time and bytes of the kernels with an estimate, their mean bandwidth, and
    the time they would save if each ran at ``at_tb_s`` at least."""
    known = [k for k in kernels if k.bytes_per_call is not None]
    us = sum(k.us for k in known)
    moved = sum(k.bytes_per_call * k.calls for k in known)  # type: ignore[operator]
    floor = sum(
        max(0.0, k.us - k.bytes_per_call * k.calls / (at_tb_s * 1e12) * 1e6)  # type: ignore[operator]
        for k in known
    )
    mean = moved / (us * 1e-6) / 1e12 if us else 0.0
    return [
        f"{len(kernels)} kernels of inductor's per step, {sum(k.us for k in kernels) / 1e3:.2f} ms;"
        f" {len(known)} with a byte estimate: {us / 1e3:.2f} ms, {moved / 1e9:.2f} GB,"
        f" **{mean:.2f} TB/s** on average",
        f"at {at_tb_s:.1f} TB/s or faster each, they would take {floor / 1e3:.2f} ms less per step",
    ]


def table(kernels: list[KernelRate], top: int) -> list[str]:
    out = [
        "| kernel | calls per step | µs per step | MB per call | TB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in kernels[:top]:
        mb = "" if k.bytes_per_call is None else f"{k.bytes_per_call / 1e6:.1f}"
        rate = k.tb_per_s()
        tb = "" if rate is None else f"{rate:.2f}"
        short = k.name if len(k.name) <= 90 else k.name[:87] + "..."
        out.append(f"| `{short}` | {k.calls:g} | {k.us:.1f} | {mb} | {tb} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("sources", type=Path, nargs="+", help="inductor's cache folder(s) or files")
    p.add_argument("--top", type=int, default=25, help="kernels to list, the longest first")
    p.add_argument("--at", type=float, default=4.0, help="TB/s to measure the kernels against")
    args = p.parse_args()
    estimates, ambiguous = kernel_bytes(args.sources)
    kernels = rates(load_trace(args.trace), estimates)
    unknown = sum(1 for k in kernels if k.bytes_per_call is None)
    print(f"{args.trace.name}: {len(estimates)} kernels estimated in the sources")
    print("\n".join(summary(kernels, args.at)))
    if unknown:
        print(f"{unknown} kernels without an estimate ({len(ambiguous)} names are ambiguous)")
    print()
    print("\n".join(table(kernels, args.top)))


if __name__ == "__main__":
    main()
