"""SM clock, power and clock-limit reasons per timed window: lines up ``bench/dali_e2e.py
--marks`` windows with an ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,...
--format=csv,noheader -lms 100`` log taken on the same machine. Asks whether DALI's end-to-end
cost is the step's kernels running at a lower clock (a power limit shared with the JPEG engines
and DALI's kernels) rather than waiting for SMs.

Usage: python bench/clocks.py SMI_CSV MARKS_JSONL
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import Counter
from datetime import datetime

FMT = "%Y/%m/%d %H:%M:%S.%f"


def number(text: str) -> float | None:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def median(samples: list[tuple], i: int) -> float:
    return statistics.median(s[i] for s in samples if s[i] is not None)


def main(smi_csv: str, marks_jsonl: str) -> None:
    with open(smi_csv) as f:
        rows = [r for r in csv.reader(f) if len(r) >= 4]
    samples = []  # (time, sm clock MHz, power W, temperature C, reasons)
    for r in rows:
        try:
            t = datetime.strptime(r[0].strip(), FMT)
        except ValueError:
            continue
        samples.append(
            (t, number(r[1]), number(r[2]), number(r[3]), r[4].strip() if len(r) > 4 else "")
        )
    print(
        "| window | samples | SM clock MHz (median) | power W (median) | temp C | limit reasons |"
    )
    print("|---|---:|---:|---:|---:|---|")
    with open(marks_jsonl) as f:
        marks = [json.loads(line) for line in f]
    for m in marks:
        start, end = datetime.strptime(m["start"], FMT), datetime.strptime(m["end"], FMT)
        inside = [s for s in samples if start <= s[0] <= end]
        if not inside:
            print(f"| {m['variant']} | 0 | | | | |")
            continue

        reasons = Counter(s[4] for s in inside).most_common(2)
        clock, power, temp = (median(inside, i) for i in (1, 2, 3))
        print(
            f"| {m['variant']} | {len(inside)} | {clock:,.0f} | {power:.0f} | {temp:.0f} | "
            f"{', '.join(f'{k} x{v}' for k, v in reasons)} |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
