"""``python -m fasttrain check-data DIR``: decode every image, list the ones that fail, and write
the list that training then leaves out."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from fasttrain.commands import say
from fasttrain.config.cli import Parser
from fasttrain.config.paths import default_exclude_list
from fasttrain.data.check import find_bad_files, find_dali_rejects, write_exclude_list
from fasttrain.data.dali_install import dali_available
from fasttrain.data.folder import scan_folder


def main(argv: Sequence[str]) -> int:
    p = Parser(
        prog="python -m fasttrain check-data",
        description="Decode every image under DIR/train and DIR/val, list the ones that fail, and "
        "write them to a list that training leaves out (found automatically for --data DIR).",
    )
    p.add_argument("dir", help="dataset root with train/ and val/ class folders")
    p.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="decoding processes (default: one per CPU core)",
    )
    p.add_argument(
        "--output",
        help="where to write the list (default: the cache, where training finds it for --data DIR)",
    )
    p.add_argument(
        "--no-dali",
        action="store_true",
        help="skip the second pass through DALI's decoder (run where DALI is installed)",
    )
    args = p.parse_args(argv)
    t = time.perf_counter()
    checked, bad = find_bad_files(
        args.dir, max(1, args.workers), progress=lambda i, n: say(f"checked {i:,} / {n:,}")
    )
    if dali_available() and not args.no_dali:
        rejected = {path for path, _ in bad}
        ds = scan_folder(args.dir)
        good = [path for path, _ in ds.train + ds.val if path not in rejected]
        say(f"decoding the {len(good):,} files PIL read with DALI's decoder too")
        bad += find_dali_rejects(
            good,
            max(1, args.workers),
            progress=lambda i, n: i % 4096 < 64 and say(f"DALI checked {i:,} / {n:,}"),
        )
    for path, reason in bad:
        print(f"{path}\t{reason}")
    out = Path(args.output) if args.output else default_exclude_list(args.dir)
    write_exclude_list(out, args.dir, bad)
    took = f"{time.perf_counter() - t:.0f} s"
    if bad:
        say(
            f"{len(bad)} of {checked:,} images failed to decode ({took}); wrote {out}, which "
            f"training on --data {args.dir} now leaves out"
        )
    else:
        say(f"all {checked:,} images decode ({took}); wrote {out}, an empty list")
    return 0
