"""A run's throughput from its metrics.jsonl, two ways: the trainer's steady figure (every
interval after the first epoch, by ``fasttrain.metrics.steady_rate`` itself), and the same
without each epoch's first interval, which holds the loader's epoch start (DALI drains the
padded tail and refills its prefetch queue).

The sample sets have 19-78 steps per epoch per GPU, so epoch starts weigh far more than on
ImageNet (5,004 steps per epoch at batch 256); the second figure is the one that carries over to
long epochs, the first is what the sample run did. Both are printed, never one alone.

Over the same in-epoch intervals, the wall time per step splits in two: the GPU time inside the
step (the log's ``gpu_step_ms``, from CUDA events around each step) and the rest
(``outside_step_ms``): the batch copy and the GPU waiting between steps, for a batch or for the
host after a log step. ``gpu_step_sd_ms`` is how much the steps' GPU times vary within an
interval (pooled over the intervals; logged since the tenth session). Under DDP it also holds
the waits for the other rank; one GPU's spread did not predict DDP's loss (BENCHMARKS.md,
eleventh session: halving it left scaling where it was).

Usage: python bench/epoch_rates.py RUN [RUN ...], each RUN a run's output directory or, where
only that came back from the GPU machine, the text of its log (as printed, or a rank's
``log-rank*.txt``). A run that
failed (no summary.json) is reported as failed, and the rest still are.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from fasttrain.metrics import steady_rate

LOG_LINE = re.compile(
    r"^(?:\S+ \S+ INFO )?epoch (\d+) step (\d+): .* ([\d,]+) img/s"  # printed, or a log-rank file
    r"(?:.* gpu ([\d.]+) ms/step(?: \(sd ([\d.]+)\))?)?",
    re.M,
)
GLOBAL_BATCH = re.compile(r"global batch (\d+)")


def records_from_log(text: str) -> tuple[list[dict], int]:
    """The train records and global batch from a run's printed log (img/s rounded as printed)."""
    train = [
        {
            "epoch": int(e),
            "step": int(s),
            "img_per_s": float(r.replace(",", "")),
            "gpu_step_ms": float(g) if g else None,
            "gpu_step_ms_sd": float(sd) if sd else None,
        }
        for e, s, r, g, sd in LOG_LINE.findall(text)
    ]
    return train, int(GLOBAL_BATCH.findall(text)[-1])


def rates(run: Path) -> dict[str, float | int | None]:
    if run.is_file():
        train, batch = records_from_log(run.read_text())
    else:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r.get("kind") == "train" and r["img_per_s"]]
        batch = json.loads((run / "summary.json").read_text())["global_batch"]
    # (epoch, images, seconds, began the epoch, steps, GPU ms per step, its standard deviation
    # within the interval), as the trainer logged them
    intervals = []
    for prev, r in zip([None, *train], train, strict=False):
        steps = r["step"] - (prev["step"] if prev else 0)
        starts_epoch = prev is None or r["epoch"] != prev["epoch"]
        images = steps * batch
        gpu = r.get("gpu_step_ms")
        sd = r.get("gpu_step_ms_sd")
        intervals.append(
            (r["epoch"], images, images / r["img_per_s"], starts_epoch, steps, gpu, sd)
        )
    # the steady intervals less the one that began each epoch
    later = [iv for iv in intervals if iv[0] > intervals[0][0] and not iv[3]]
    seconds = sum(iv[2] for iv in later)
    steps = sum(iv[4] for iv in later)
    timed = [iv for iv in later if iv[5] is not None]
    wall_ms = 1e3 * seconds / steps if steps else None
    gpu_ms = sum(iv[5] * iv[4] for iv in timed) / sum(iv[4] for iv in timed) if timed else None
    spread = [iv for iv in later if iv[6] is not None]  # pooled over the intervals
    pooled = sum(iv[6] ** 2 * iv[4] for iv in spread) / sum(iv[4] for iv in spread) if spread else 0
    return {
        "steady_img_per_s": steady_rate([iv[:3] for iv in intervals]),
        "in_epoch_img_per_s": sum(iv[1] for iv in later) / seconds if seconds else None,
        "global_batch": batch,
        "wall_ms_per_step": wall_ms,
        "gpu_step_ms": gpu_ms,
        "outside_step_ms": wall_ms - gpu_ms if timed and len(timed) == len(later) else None,
        "gpu_step_sd_ms": math.sqrt(pooled) if spread else None,
    }


def main() -> None:
    for arg in sys.argv[1:]:
        run = Path(arg)
        if run.is_dir() and not (run / "summary.json").is_file():
            print(json.dumps({"run": run.name, "failed": True}))
            continue
        print(json.dumps({"run": run.name, **rates(run)}))


if __name__ == "__main__":
    main()
