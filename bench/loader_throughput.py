"""Loader alone, side by side in one process: DALI at several hw_decoder_load values and thread
counts, and the torchvision loader, on one dataset. Each variant: one warm-up epoch, then the
images of EPOCHS epochs over the wall time between two device syncs.

Usage on the GPU machine: python bench/loader_throughput.py DATA_DIR [--epochs 4]
"""

from __future__ import annotations

import argparse
import time

import torch

from fasttrain.data.dali import DaliLoader
from fasttrain.data.folder import scan_folder
from fasttrain.data.torchvision import build_torchvision_loader


def rate(loader, epochs: int) -> float:
    def one_epoch(e: int) -> int:
        loader.set_epoch(e)
        n = 0
        for x, _ in loader:
            n += x.shape[0]
        return n

    one_epoch(0)  # warm-up: worker start-up, decoder buffers, allocator growth
    torch.cuda.synchronize()
    t = time.perf_counter()
    images = sum(one_epoch(e) for e in range(1, epochs + 1))
    torch.cuda.synchronize()
    return images / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("data")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    train = scan_folder(args.data).train
    dev = torch.device("cuda")
    common = dict(
        train=True,
        image_size=224,
        batch_size=256,
        seed=0,
        rank=0,
        world=1,
        device=dev,
        dtype=torch.bfloat16,
        channels_last=True,
    )
    rows = []
    for load in (0.0, 0.65, 0.99):
        for threads in (4, 8):
            ld = DaliLoader(train, threads=threads, hw_decoder_load=load, local_rank=0, **common)
            rows.append((f"DALI hw_decoder_load={load} threads={threads}", rate(ld, args.epochs)))
            print(f"{rows[-1][0]:45s} {rows[-1][1]:9,.0f} img/s", flush=True)
            del ld
    for workers in (8, 16):
        ld = build_torchvision_loader(train, workers=workers, **common)
        rows.append((f"torchvision workers={workers}", rate(ld, max(1, args.epochs // 2))))
        print(f"{rows[-1][0]:45s} {rows[-1][1]:9,.0f} img/s", flush=True)
    print(f"\n{len(train):,} train images, batch 256, 224 px, bf16 channels_last out")


if __name__ == "__main__":
    main()
