"""A profiled run's breakdown and top kernels in TensorBoard's own dashboards, for every rank.

TensorBoard's PyTorch Profiler plugin draws its views with scripts fetched from the internet at
page load, so on a cluster without internet its tab stays blank. Text and Images are built into
TensorBoard and need nothing from outside, so a ``--profile`` run writes what it knows there:

- ``profile/breakdown`` (Text): one row per rank: the step and its four parts (compute, NCCL not
  overlapped, copies alone, GPU idle), the host's time waiting for the loader, copying to the
  device and in sync calls, and the rank's trace files;
- ``profile/top_kernels`` (Text): per rank, the GPU time by kernel class and the longest kernels;
- ``profile/idle_gaps`` (Text): per rank, where the GPU sat idle inside the steps: the gaps by
  length and by the kernel classes on either side (``gaps.py``);
- ``profile/step_parts`` (Images): each rank's step as a stacked bar by part, and its GPU time by
  kernel class, side by side, so an unbalanced rank shows at a glance (needs matplotlib, the
  ``profile`` extra).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fasttrain.metrics.breakdown import PARTS
from fasttrain.metrics.gaps import Gaps
from fasttrain.metrics.kernels import KernelSplit

log = logging.getLogger("fasttrain")

TOP = 10  # the longest kernels listed per rank
LABELS = {
    "compute": "compute",
    "comm_exposed": "NCCL, not overlapped",
    "memory_exposed": "copies alone",
    "idle": "GPU idle",
}
HOST = {
    "host_loader_wait": "host: loader wait",
    "host_copy_in": "host: copy to device",
    "host_sync": "host: sync calls",
}
COLORS = {"compute": "#4c72b0", "comm_exposed": "#dd8452", "memory_exposed": "#55a868"}
COLORS["idle"] = "#c7c7c7"
LEGEND = {"fontsize": "small", "loc": "upper center", "bbox_to_anchor": (0.5, -0.3), "ncol": 3}
LEGEND["frameon"] = False


@dataclass
class RankProfile:
    """What one rank's profiled steps came to: what the main process gathers and writes."""

    rank: int
    traces: list[str]
    mean_ms: dict[str, float] | None  # ``breakdown.StepTimes`` as a dict; None: no steps
    device: str  # "gpu", or "cpu" when the traces hold no GPU activity
    kernels: KernelSplit = field(default_factory=KernelSplit)
    gaps: Gaps = field(default_factory=Gaps)

    def compact(self) -> RankProfile:
        """The same, with only the longest kernels by name and the idlest neighbour pairs: what
        every rank sends stays small."""
        keep = dict(sorted(self.kernels.by_name.items(), key=lambda kv: -kv[1])[:TOP])
        k = KernelSplit(self.kernels.steps, dict(self.kernels.by_class), keep)
        return RankProfile(
            self.rank, self.traces, self.mean_ms, self.device, k, self.gaps.compact(TOP)
        )


def _cell(ms: float, total: float) -> str:
    return f"{ms:.2f} ({100 * ms / total:.0f}%)" if total > 0 else f"{ms:.2f}"


def breakdown_markdown(ranks: list[RankProfile]) -> str:
    """The breakdown as a markdown table, one row per rank (milliseconds, mean step)."""
    parts = [LABELS[p] for p in PARTS]
    lines = [
        "Mean profiled step after each cycle's first, in ms (share of the step). The four parts "
        "sum to the step; the host's figures overlap them. On a CPU run compute is the host "
        "computing and idle the host waiting.",
        "",
        "| rank | step | " + " | ".join(parts) + " | " + " | ".join(HOST.values()) + " | trace |",
        "|---" * (3 + len(parts) + len(HOST)) + "|",
    ]
    for r in sorted(ranks, key=lambda r: r.rank):
        traces = ", ".join(f"`{t}`" for t in r.traces) or "none"
        m = r.mean_ms
        if m is None:
            empty = " | ".join([""] * (len(parts) + len(HOST)))
            lines.append(f"| {r.rank} | no profiled steps | {empty} | {traces} |")
            continue
        cells = [_cell(m[p], m["total"]) for p in PARTS]
        cells += [f"{m[h]:.2f}" for h in HOST]
        lines.append(f"| {r.rank} | {m['total']:.2f} | " + " | ".join(cells) + f" | {traces} |")
    return "\n".join(lines)


def kernels_markdown(ranks: list[RankProfile]) -> str:
    """Per rank: GPU time by kernel class, and the longest kernels with their class."""
    out = []
    for r in sorted(ranks, key=lambda r: r.rank):
        k = r.kernels
        out.append(f"**rank {r.rank}**")
        out.append("")
        if not k.by_class:
            out.append(
                "No GPU kernels in the profiled steps (a CPU run): the host's operators are "
                "in the trace."
            )
            out.append("")
            continue
        out += [f"{k.per_step():.2f} ms of GPU work per step over {k.steps} profiled steps.", ""]
        out += [*k.tables(TOP), ""]
    return "\n".join(out).rstrip()


def figure(ranks: list[RankProfile]) -> Any:
    """A matplotlib figure: each rank's step by part (ms), and its GPU time by kernel class."""
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display on a cluster node
    import matplotlib.pyplot as plt

    ranks = sorted(ranks, key=lambda r: r.rank)
    names = [f"rank {r.rank}" for r in ranks]
    height = 2.4 + 0.4 * len(ranks)  # room for the legends below the bars
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, height), constrained_layout=True)
    cpu = all(r.device == "cpu" for r in ranks)
    starts = [0.0] * len(ranks)
    for part in PARTS:
        widths = [(r.mean_ms or {}).get(part, 0.0) for r in ranks]
        label = {"compute": "host computing", "idle": "host waiting"}.get(part) if cpu else None
        left.barh(names, widths, left=starts, color=COLORS[part], label=label or LABELS[part])
        starts = [s + w for s, w in zip(starts, widths, strict=True)]
    left.set_xlabel("ms per step")
    left.set_title("step by part")
    left.invert_yaxis()
    left.legend(**LEGEND)
    classes = sorted({c for r in ranks for c in r.kernels.by_class})
    if classes:
        cmap = plt.get_cmap("tab10")
        starts = [0.0] * len(ranks)
        shares = [r.kernels.shares() for r in ranks]
        for i, c in enumerate(classes):
            widths = [100 * share.get(c, 0.0) for share in shares]
            right.barh(names, widths, left=starts, color=cmap(i % 10), label=c)
            starts = [s + w for s, w in zip(starts, widths, strict=True)]
        right.set_xlim(0, 100)
        right.legend(**LEGEND)
    else:
        right.text(0.5, 0.5, "no GPU kernels (a CPU run)", ha="center", va="center")
        right.set_yticks([])
        right.set_xticks([])
    right.set_xlabel("% of GPU time")
    right.set_title("GPU time by kernel class")
    right.invert_yaxis()
    return fig


def gaps_markdown(ranks: list[RankProfile]) -> str:
    """Per rank: the GPU's idle gaps inside the profiled steps, by length and by neighbours."""
    out = []
    for r in sorted(ranks, key=lambda r: r.rank):
        out += [f"**rank {r.rank}**", ""]
        if not r.kernels.by_class:
            out += ["No GPU kernels in the profiled steps (a CPU run).", ""]
            continue
        out += [*r.gaps.tables(TOP), ""]
    return "\n".join(out).rstrip()


def write(writer: Any, step: int, ranks: list[RankProfile]) -> None:
    """Write the four entries (module notes) with a ``SummaryWriter``; without matplotlib, the
    text only, and a line saying how to get the picture."""
    writer.add_text("profile/breakdown", breakdown_markdown(ranks), step)
    writer.add_text("profile/top_kernels", kernels_markdown(ranks), step)
    writer.add_text("profile/idle_gaps", gaps_markdown(ranks), step)
    try:
        fig = figure(ranks)
    except ImportError:
        log.info(
            "--profile: the breakdown's picture in TensorBoard needs matplotlib: "
            "pip install 'fasttrain[profile]'"
        )
        return
    writer.add_figure("profile/step_parts", fig, step, close=True)
