"""Where the GPU sits idle inside a step, from a ``--profile`` trace: every gap between two
consecutive pieces of GPU work of the profiled steps, by the classes of the work on either side
(``kernels.classify``) and by its length.

``breakdown.py``'s ``idle`` is the sum of these gaps; this says which neighbours leave them and
how long each is. Many short gaps are the GPU's wait between dependent kernels (a CUDA-graph
replay still pays a microsecond or two per kernel), which fewer kernels or programmatic
dependent launch would shorten; a few long ones are a wait on something else (the host, another
stream, a copy). Work is tied to its step as ``kernels.split`` ties it (Kineto's correlation
ids); a gap between the last work of one step and the first of the next is counted apart, as
the steps' seam.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from fasttrain.metrics.kernels import classify, profiled_work

BINS = ((1.0, "up to 1 µs"), (2.0, "1-2 µs"), (5.0, "2-5 µs"), (20.0, "5-20 µs"))
LONGEST = "over 20 µs"


def length_bin(us: float) -> str:
    """The length class of one gap."""
    for edge, label in BINS:
        if us <= edge:
            return label
    return LONGEST


@dataclass
class Gaps:
    """Idle gaps summed over ``steps`` profiled steps: by the classes before and after each gap
    (count, µs), by length (count, µs), and at the seams between steps (count, µs)."""

    steps: int = 0
    by_pair: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    by_length: dict[str, tuple[int, float]] = field(default_factory=dict)
    seams: tuple[int, float] = (0, 0.0)

    def add(self, other: Gaps) -> Gaps:
        """Both traces' gaps together (one rank's cycles)."""

        def merged(a: dict, b: dict) -> dict:
            out = dict(a)
            for k, (n, us) in b.items():
                n0, us0 = out.get(k, (0, 0.0))
                out[k] = (n0 + n, us0 + us)
            return out

        return Gaps(
            self.steps + other.steps,
            merged(self.by_pair, other.by_pair),
            merged(self.by_length, other.by_length),
            (self.seams[0] + other.seams[0], self.seams[1] + other.seams[1]),
        )

    def ranked(self, top: int) -> list[tuple[tuple[str, str], tuple[int, float]]]:
        """The ``top`` neighbour pairs by idle time, the idlest first."""
        return sorted(self.by_pair.items(), key=lambda kv: -kv[1][1])[:top]

    def compact(self, top: int) -> Gaps:
        """The same with only the ``top`` neighbour pairs by idle time (what a rank sends);
        the totals (``idle_ms``, ``count``) come from the length bins, which keep every gap."""
        return Gaps(self.steps, dict(self.ranked(top)), dict(self.by_length), self.seams)

    def as_dict(self, top: int) -> dict:
        """For JSON: per step, by length and the ``top`` pairs (ms, gaps)."""
        steps = max(self.steps, 1)
        return {
            "idle_ms": self.idle_ms(),
            "gaps": self.count(),
            "seam_ms": self.seams[1] / 1000.0 / steps,
            "by_length": {k: {"gaps": n / steps, "ms": us / 1000.0 / steps}
                          for k, (n, us) in self.by_length.items()},
            "by_pair": [{"before": b, "after": a, "gaps": n / steps, "ms": us / 1000.0 / steps}
                        for (b, a), (n, us) in self.ranked(top)],
        }  # fmt: skip

    def idle_ms(self) -> float:
        """Idle milliseconds per step inside the steps (the seams left out)."""
        return sum(us for _, us in self.by_length.values()) / 1000.0 / max(self.steps, 1)

    def count(self) -> float:
        """Gaps per step inside the steps."""
        return sum(n for n, _ in self.by_length.values()) / max(self.steps, 1)

    def tables(self, top: int) -> list[str]:
        """Markdown: gaps by length, then the ``top`` neighbour pairs by idle time, per step."""
        steps = max(self.steps, 1)
        out = [
            f"{self.idle_ms():.3f} ms idle per step in {self.count():.0f} gaps; the seam between"
            f" steps {self.seams[1] / 1000.0 / steps:.3f} ms per step",
            "",
            "| gap length | gaps per step | ms per step |",
            "|---|---:|---:|",
        ]
        for label in [b for _, b in BINS] + [LONGEST]:
            n, us = self.by_length.get(label, (0, 0.0))
            out.append(f"| {label} | {n / steps:.1f} | {us / 1000.0 / steps:.3f} |")
        out += [
            "",
            "| before | after | gaps per step | ms per step | mean µs |",
            "|---|---|---:|---:|---:|",
        ]
        for (before, after), (n, us) in self.ranked(top):
            out.append(
                f"| {before} | {after} | {n / steps:.1f} | {us / 1000.0 / steps:.3f} |"
                f" {us / max(n, 1):.2f} |"
            )
        return out


def gaps(trace: dict[str, Any]) -> Gaps:
    """The idle gaps of the trace's profiled steps (module notes). Without correlation ids every
    piece of GPU work counts, as one stretch."""
    steps, events = profiled_work(trace)
    work = []
    for e, step in events:
        if "ts" in e:
            start = float(e["ts"])
            label = classify(e.get("name", ""), e.get("cat", ""))
            work.append((start, start + float(e["dur"]), step, label))
    work.sort()
    by_pair: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    by_length: dict[str, list] = defaultdict(lambda: [0, 0.0])
    seams = [0, 0.0]
    if work:
        end, step, before = work[0][1], work[0][2], work[0][3]
        for start, stop, s, label in work[1:]:
            gap = start - end
            if gap > 0:
                kept = (
                    [seams] if s != step else [by_pair[(before, label)], by_length[length_bin(gap)]]
                )
                for into in kept:
                    into[0] += 1
                    into[1] += gap
            if stop >= end:
                end, step, before = stop, s, label
    return Gaps(
        steps,
        {k: (n, us) for k, (n, us) in by_pair.items()},
        {k: (n, us) for k, (n, us) in by_length.items()},
        (seams[0], seams[1]),
    )
