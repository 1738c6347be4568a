"""A run's throughput from its metrics.jsonl, two ways: the trainer's steady figure (every
interval after the first epoch), and the same without each epoch's first interval, which holds
the loader's epoch start (DALI drains the padded tail and refills its prefetch queue).

The sample sets have 19-78 steps per epoch per GPU, so epoch starts weigh far more than on
ImageNet (5,004 steps per epoch at batch 256); the second figure is the one that carries over to
long epochs, the first is what the sample run did. Both are printed, never one alone.

Usage: python bench/epoch_rates.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path


def rates(run_dir: Path) -> dict[str, float | int | None]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    batch = json.loads((run_dir / "summary.json").read_text())["global_batch"]
    first_epoch = train[0]["epoch"] if train else 0
    steady = [0.0, 0.0]  # images, seconds
    in_epoch = [0.0, 0.0]
    for prev, r in itertools.pairwise(train):
        if r["epoch"] == first_epoch or not r["img_per_s"]:
            continue
        images = (r["step"] - prev["step"]) * batch
        seconds = images / r["img_per_s"]
        steady[0] += images
        steady[1] += seconds
        if r["epoch"] == prev["epoch"]:  # not the interval that began the epoch
            in_epoch[0] += images
            in_epoch[1] += seconds
    return {
        "steady_img_per_s": steady[0] / steady[1] if steady[1] else None,
        "in_epoch_img_per_s": in_epoch[0] / in_epoch[1] if in_epoch[1] else None,
        "global_batch": batch,
    }


def main() -> None:
    for arg in sys.argv[1:]:
        print(json.dumps({"run": Path(arg).name, **rates(Path(arg))}))


if __name__ == "__main__":
    main()
