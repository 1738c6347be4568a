"""Turn ``pytest bench/ --benchmark-json out.json`` into a markdown table (stdout) and a PNG chart
for BENCHMARKS.md: one row per benchmark, with the figure each group cares about (img/s, GB/s or
us per call). The chart needs matplotlib (``pip install matplotlib``).

Usage: python bench/report.py out.json [--png bench.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

FIGURES = ("img_per_s", "GB_per_s", "us_per_call")


def rows(data: dict) -> list[tuple[str, str, str, float, float | None]]:
    """(group, name, figure, value, peak GiB or None) per benchmark that records a figure."""
    out = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        figure = next((f for f in FIGURES if f in info), None)
        if figure is None:
            continue
        peak = info.get("peak_gib")
        out.append((b.get("group") or "", b["name"], figure, float(info[figure]), peak))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--png")
    args = p.parse_args()
    data = json.loads(Path(args.json).read_text())
    table = rows(data)
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {}).get("id", "")[:7]
    print(f"{machine.get('node', '')} | {data.get('datetime', '')} | commit {commit}\n")
    print("| group | benchmark | figure | value | peak memory GiB |\n|---|---|---|---:|---:|")
    for group, name, figure, value, peak in table:
        peak_text = f"{peak:.1f}" if peak is not None else ""
        print(f"| {group} | {name} | {figure} | {value:,.1f} | {peak_text} |")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        by_group = defaultdict(list)
        for group, name, figure, value, _ in table:
            by_group[(group, figure)].append((name.split("[")[-1].rstrip("]"), value))
        fig, axes = plt.subplots(len(by_group), 1, figsize=(8, 2.2 * len(by_group)), squeeze=False)
        for ax, ((group, figure), items) in zip(axes[:, 0], by_group.items(), strict=True):
            ax.barh([n for n, _ in items], [v for _, v in items])
            ax.set_title(f"{group} ({figure})", fontsize=9)
            ax.tick_params(labelsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
