"""The normalize kernel's tile shapes side by side on one GPU, with and without the per-sample
flip, against the device copy and torch's own uint8 -> bf16 conversion (one read, one write:
the floor for any kernel of this shape). Prints a markdown table; the fastest tile is what
``kernels/normalize.py``'s DEFAULT_TILE should be.

Usage on the GPU machine: python bench/normalize_tiles.py [--batch 256 --size 224]
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
from fasttrain.kernels.normalize import DEFAULT_TILE, normalize

MEAN = (123.675, 116.28, 103.53)
STD = (58.395, 57.12, 57.375)


def gb_per_s(fn, bytes_moved: int, calls: int = 50, rounds: int = 7) -> float:
    """Median over ``rounds`` of ``calls`` calls replayed from a CUDA graph between two CUDA
    events, after a warm-up: device time only (a call is ~50 us, close to Python's launch
    cost on a busy host)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / calls)
    return bytes_moved / statistics.median(per_call) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    args = p.parse_args()
    images = torch.randint(
        0, 256, (args.batch, args.size, args.size, 3), dtype=torch.uint8, device="cuda"
    )
    n = images.numel()
    moved = 3 * n  # 1 byte read + 2 written per value
    mean, std = torch.tensor(MEAN, device="cuda"), torch.tensor(STD, device="cuda")
    flip = torch.rand(args.batch, device="cuda") < 0.5
    out = torch.empty(images.shape, dtype=torch.bfloat16, device="cuda").permute(0, 3, 1, 2)
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    wide = torch.empty(images.shape, dtype=torch.bfloat16, device="cuda")
    copy = gb_per_s(lambda: dst.copy_(src), moved)
    rows = [
        ("device copy (same bytes)", None, copy),
        ("torch uint8 -> bf16 conversion only", None, gb_per_s(lambda: wide.copy_(images), moved)),
    ]
    tiles = {
        t
        for t in itertools.product((4, 8, 16, 32), (128, 256, 1024), (4, 8))
        if t[0] * t[1] <= 8192
    }
    for tile in sorted(tiles | {DEFAULT_TILE}):
        for f in (None, flip):
            rate = gb_per_s(
                lambda f=f, t=tile: normalize(images, mean, std, f, out=out, tile=t), moved
            )
            rows.append((f"triton, tile {tile}", f is not None, rate))
    print(f"batch {args.batch} x {args.size}^2 x 3, {torch.cuda.get_device_name()}")
    print("| variant | flip | GB/s | of copy |\n|---|---|---:|---:|")
    for name, flipped, rate in rows:
        mark = "" if flipped is None else ("yes" if flipped else "no")
        print(f"| {name} | {mark} | {rate:,.0f} | {100 * rate / copy:.0f}% |")
    best = max((r for r in rows if r[1] is False), key=lambda r: r[2])
    print(f"fastest without flip: {best[0]}, {best[2]:,.0f} GB/s ({100 * best[2] / copy:.0f}%)")


if __name__ == "__main__":
    main()
